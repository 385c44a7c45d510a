/* The interface of a bnfuse training graph, as the file records it: the JSON of metadata key "bnfuse.training"
 * (docs/hosts.md, "The contract"). */
#ifndef BNFUSE_EXAMPLE_SPEC_H
#define BNFUSE_EXAMPLE_SPEC_H

#include <stddef.h>

typedef struct {
    char **data;    /* data inputs, fed with every step */
    size_t data_count;
    char **targets; /* labels (or gradient seeds) */
    size_t target_count;
    char *lr;       /* the learning-rate input: a float32 scalar */
    char *loss;     /* the loss output: a float32 scalar */
    char **outputs; /* the inference model's outputs, also computed by the step */
    size_t output_count;
    char **state_inputs;  /* every state input ... */
    char **state_outputs; /* ... and the output holding its value after the step */
    size_t state_count;
} training_spec;

/* Parses the metadata JSON into `spec`; 0 on success, else -1 with a message in `error`. */
int spec_parse(const char *json, training_spec *spec, char *error, size_t error_size);

void spec_free(training_spec *spec);

#endif
