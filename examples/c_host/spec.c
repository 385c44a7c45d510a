/* A small JSON reader for the training spec: the keys the step needs (strings, lists of strings, and the state
 * object of string pairs); every other value is parsed and skipped. */
#include "spec.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const char *at;
    int failed;
} reader;

static void skip_space(reader *r) {
    while (*r->at == ' ' || *r->at == '\n' || *r->at == '\t' || *r->at == '\r') {
        r->at++;
    }
}

static int expect(reader *r, char c) {
    skip_space(r);
    if (*r->at != c) {
        r->failed = 1;
        return 0;
    }
    r->at++;
    return 1;
}

static unsigned hex4(const char *p) {
    unsigned value = 0;
    for (int i = 0; i < 4; i++) {
        char c = p[i];
        value = value * 16 + (unsigned)(c >= '0' && c <= '9' ? c - '0' : (c | 32) - 'a' + 10);
    }
    return value;
}

static size_t put_utf8(char *out, unsigned code) {
    if (code < 0x80) {
        out[0] = (char)code;
        return 1;
    }
    if (code < 0x800) {
        out[0] = (char)(0xc0 | code >> 6);
        out[1] = (char)(0x80 | (code & 0x3f));
        return 2;
    }
    if (code < 0x10000) {
        out[0] = (char)(0xe0 | code >> 12);
        out[1] = (char)(0x80 | (code >> 6 & 0x3f));
        out[2] = (char)(0x80 | (code & 0x3f));
        return 3;
    }
    out[0] = (char)(0xf0 | code >> 18);
    out[1] = (char)(0x80 | (code >> 12 & 0x3f));
    out[2] = (char)(0x80 | (code >> 6 & 0x3f));
    out[3] = (char)(0x80 | (code & 0x3f));
    return 4;
}

/* A JSON string, decoded (malloc'ed), or NULL on a syntax error. */
static char *read_string(reader *r) {
    if (!expect(r, '"')) {
        return NULL;
    }
    const char *end = r->at;
    while (*end && *end != '"') {
        end += *end == '\\' && end[1] ? 2 : 1;
    }
    char *out = malloc((size_t)(end - r->at) * 2 + 1), *w = out; /* an escape never grows */
    while (out && r->at < end) {
        char c = *r->at++;
        if (c != '\\') {
            *w++ = c;
            continue;
        }
        c = *r->at++;
        const char *plain = strchr("\"\\/bfnrt", c);
        if (plain && c != 'u') {
            *w++ = "\"\\/\b\f\n\r\t"[plain - "\"\\/bfnrt"];
        } else if (c == 'u' && end - r->at >= 4) {
            unsigned code = hex4(r->at);
            r->at += 4;
            if (code >= 0xd800 && code < 0xdc00 && end - r->at >= 6 && r->at[0] == '\\' && r->at[1] == 'u') {
                code = 0x10000 + ((code - 0xd800) << 10) + (hex4(r->at + 2) - 0xdc00);
                r->at += 6;
            }
            w += put_utf8(w, code);
        } else {
            r->failed = 1;
        }
    }
    if (!out || *end != '"' || r->failed) {
        free(out);
        r->failed = 1;
        return NULL;
    }
    *w = 0;
    r->at = end + 1;
    return out;
}

static void skip_value(reader *r);

static void skip_container(reader *r, char close, int keyed) {
    r->at++;
    skip_space(r);
    if (*r->at == close) {
        r->at++;
        return;
    }
    do {
        if (keyed) {
            free(read_string(r));
            expect(r, ':');
        }
        skip_value(r);
        skip_space(r);
    } while (!r->failed && *r->at == ',' && r->at++);
    expect(r, close);
}

static void skip_value(reader *r) {
    skip_space(r);
    if (*r->at == '"') {
        free(read_string(r));
    } else if (*r->at == '[') {
        skip_container(r, ']', 0);
    } else if (*r->at == '{') {
        skip_container(r, '}', 1);
    } else if (strchr("-0123456789tfn", *r->at) && *r->at) {
        while (*r->at && !strchr(",]} \n\t\r", *r->at)) {
            r->at++; /* number, true, false, null */
        }
    } else {
        r->failed = 1;
    }
}

/* A list of strings, appended to *items. */
static void read_strings(reader *r, char ***items, size_t *count) {
    if (!expect(r, '[')) {
        return;
    }
    skip_space(r);
    if (*r->at == ']') {
        r->at++;
        return;
    }
    do {
        char *item = read_string(r);
        char **grown = item ? realloc(*items, (*count + 1) * sizeof **items) : NULL;
        if (!grown) {
            free(item);
            r->failed = 1;
            return;
        }
        *items = grown;
        (*items)[(*count)++] = item;
        skip_space(r);
    } while (*r->at == ',' && r->at++);
    expect(r, ']');
}

/* {"input": "output", ...} */
static void read_pairs(reader *r, training_spec *spec) {
    if (!expect(r, '{')) {
        return;
    }
    skip_space(r);
    if (*r->at == '}') {
        r->at++;
        return;
    }
    do {
        char *input = read_string(r);
        char *output = expect(r, ':') ? read_string(r) : NULL;
        char **inputs = output ? realloc(spec->state_inputs, (spec->state_count + 1) * sizeof(char *)) : NULL;
        if (inputs) {
            spec->state_inputs = inputs;
        }
        char **outputs = inputs ? realloc(spec->state_outputs, (spec->state_count + 1) * sizeof(char *)) : NULL;
        if (!outputs) {
            free(input);
            free(output);
            r->failed = 1;
            return;
        }
        spec->state_outputs = outputs;
        spec->state_inputs[spec->state_count] = input;
        spec->state_outputs[spec->state_count++] = output;
        skip_space(r);
    } while (*r->at == ',' && r->at++);
    expect(r, '}');
}

int spec_parse(const char *json, training_spec *spec, char *error, size_t error_size) {
    memset(spec, 0, sizeof *spec);
    reader r = {json, 0};
    expect(&r, '{');
    skip_space(&r);
    while (!r.failed && *r.at != '}') {
        char *key = read_string(&r);
        if (!key || !expect(&r, ':')) {
            free(key);
            break;
        }
        if (strcmp(key, "data") == 0) {
            read_strings(&r, &spec->data, &spec->data_count);
        } else if (strcmp(key, "targets") == 0) {
            read_strings(&r, &spec->targets, &spec->target_count);
        } else if (strcmp(key, "outputs") == 0) {
            read_strings(&r, &spec->outputs, &spec->output_count);
        } else if (strcmp(key, "lr") == 0) {
            spec->lr = read_string(&r);
        } else if (strcmp(key, "loss") == 0) {
            spec->loss = read_string(&r);
        } else if (strcmp(key, "state") == 0) {
            read_pairs(&r, spec);
        } else {
            skip_value(&r);
        }
        free(key);
        skip_space(&r);
        if (*r.at == ',') {
            r.at++;
            skip_space(&r);
        }
    }
    if (r.failed || !spec->lr || !spec->loss || spec->data_count == 0 || spec->target_count == 0) {
        snprintf(error, error_size, "the bnfuse.training metadata is not a training spec (near offset %ld)",
                 (long)(r.at - json));
        spec_free(spec);
        return -1;
    }
    return 0;
}

static void free_list(char **items, size_t count) {
    for (size_t i = 0; i < count; i++) {
        free(items[i]);
    }
    free(items);
}

void spec_free(training_spec *spec) {
    free_list(spec->data, spec->data_count);
    free_list(spec->targets, spec->target_count);
    free_list(spec->outputs, spec->output_count);
    free_list(spec->state_inputs, spec->state_count);
    free_list(spec->state_outputs, spec->state_count);
    free(spec->lr);
    free(spec->loss);
    memset(spec, 0, sizeof *spec);
}
