/* numpy.savez archives: zip local file headers (stored, zip64 sizes as numpy writes them), each member an .npy
 * file (magic, version, a Python-dict header, the data in C order). Enough for the data files of `bnfuse train`. */
#include "npz.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint32_t le16(const unsigned char *p) { return (uint32_t)p[0] | (uint32_t)p[1] << 8; }
static uint32_t le32(const unsigned char *p) { return le16(p) | le16(p + 2) << 16; }
static uint64_t le64(const unsigned char *p) { return (uint64_t)le32(p) | (uint64_t)le32(p + 4) << 32; }

static int fail(char *error, size_t size, const char *path, const char *what) {
    snprintf(error, size, "%s: %s", path, what);
    return -1;
}

/* The .npy header dict, e.g. {'descr': '<f4', 'fortran_order': False, 'shape': (1797, 1, 8, 8), } */
static int parse_header(const char *text, size_t length, npz_array *array) {
    char header[1024];
    if (length >= sizeof header) {
        return -1;
    }
    memcpy(header, text, length);
    header[length] = 0;
    const char *descr = strstr(header, "'descr':");
    const char *order = strstr(header, "'fortran_order':");
    const char *shape = strstr(header, "'shape':");
    if (!descr || !order || !shape) {
        return -1;
    }
    descr = strchr(descr + 8, '\'');
    if (!descr || (descr[1] != '<' && descr[1] != '|') || !strchr("fiub", descr[2])) {
        return -1; /* big-endian or non-numeric data */
    }
    array->kind = descr[2];
    array->item_size = atoi(descr + 3);
    if (strncmp(strchr(order, ':') + 1, " False", 6) != 0 || array->item_size <= 0) {
        return -1;
    }
    const char *p = strchr(shape, '(');
    if (!p) {
        return -1;
    }
    array->rank = 0;
    array->count = 1;
    for (p++; *p && *p != ')';) {
        char *end;
        long long dim = strtoll(p, &end, 10);
        if (end == p) {
            p++; /* ',' or ' ' */
            continue;
        }
        if (array->rank == NPZ_MAX_RANK || dim < 0) {
            return -1;
        }
        array->shape[array->rank++] = dim;
        array->count *= dim;
        p = end;
    }
    return 0;
}

int npz_read(const char *path, npz_archive *archive, char *error, size_t error_size) {
    memset(archive, 0, sizeof *archive);
    FILE *file = fopen(path, "rb");
    if (!file) {
        return fail(error, error_size, path, "cannot open");
    }
    fseek(file, 0, SEEK_END);
    long size = ftell(file);
    fseek(file, 0, SEEK_SET);
    unsigned char *bytes = size > 0 ? malloc((size_t)size) : NULL;
    int read_ok = bytes && fread(bytes, 1, (size_t)size, file) == (size_t)size;
    fclose(file);
    if (!read_ok) {
        free(bytes);
        return fail(error, error_size, path, "cannot read");
    }
    int status = 0;
    size_t at = 0;
    while (at + 30 <= (size_t)size && le32(bytes + at) == 0x04034b50) { /* local file header */
        const unsigned char *local = bytes + at;
        uint32_t method = le16(local + 8), name_length = le16(local + 26), extra_length = le16(local + 28);
        uint64_t stored = le32(local + 18);
        const unsigned char *name = local + 30, *extra = name + name_length;
        for (const unsigned char *e = extra; e + 4 <= extra + extra_length; e += 4 + le16(e + 2)) {
            if (le16(e) == 0x0001 && stored == 0xffffffffu && le16(e + 2) >= 16) {
                stored = le64(e + 12); /* zip64: uncompressed size, then compressed size */
            }
        }
        const unsigned char *member = extra + extra_length;
        if (method != 0) {
            status = fail(error, error_size, path, "compressed member (numpy.savez_compressed): write it with numpy.savez");
            break;
        }
        if (member + stored > bytes + size || stored < 10 || memcmp(member, "\x93NUMPY", 6) != 0) {
            status = fail(error, error_size, path, "a member is not an .npy file");
            break;
        }
        if (archive->count == NPZ_MAX_ARRAYS || name_length >= NPZ_NAME) {
            status = fail(error, error_size, path, "too many arrays or too long a name");
            break;
        }
        npz_array *array = &archive->arrays[archive->count];
        size_t header_length = member[6] == 1 ? le16(member + 8) : le32(member + 8);
        size_t header_start = member[6] == 1 ? 10 : 12;
        if (header_start + header_length > stored ||
            parse_header((const char *)member + header_start, header_length, array) != 0) {
            status = fail(error, error_size, path, "unsupported .npy header (need little-endian numbers, C order)");
            break;
        }
        size_t data_bytes = (size_t)array->count * (size_t)array->item_size;
        if (header_start + header_length + data_bytes > stored) {
            status = fail(error, error_size, path, "truncated array");
            break;
        }
        memcpy(array->name, name, name_length);
        array->name[name_length] = 0;
        char *suffix = strstr(array->name, ".npy");
        if (suffix) {
            *suffix = 0;
        }
        /* an aligned copy: the member's offset in the zip is arbitrary */
        array->data = aligned_alloc(64, (data_bytes + 63) / 64 * 64 + 64);
        if (!array->data) {
            status = fail(error, error_size, path, "out of memory");
            break;
        }
        memcpy(array->data, member + header_start + header_length, data_bytes);
        archive->count++;
        at = (size_t)(member - bytes) + stored;
    }
    if (status == 0 && archive->count == 0) {
        status = fail(error, error_size, path, "no arrays (not an .npz archive?)");
    }
    free(bytes);
    if (status != 0) {
        npz_free(archive);
    }
    return status;
}

npz_array *npz_find(npz_archive *archive, const char *name) {
    for (int i = 0; i < archive->count; i++) {
        if (strcmp(archive->arrays[i].name, name) == 0) {
            return &archive->arrays[i];
        }
    }
    return NULL;
}

void npz_free(npz_archive *archive) {
    for (int i = 0; i < archive->count; i++) {
        free(archive->arrays[i].data);
    }
    archive->count = 0;
}
