/* Arrays from an .npz file written by numpy.savez (a zip archive of .npy files, stored without compression). */
#ifndef BNFUSE_EXAMPLE_NPZ_H
#define BNFUSE_EXAMPLE_NPZ_H

#include <stddef.h>
#include <stdint.h>

enum { NPZ_MAX_RANK = 8, NPZ_MAX_ARRAYS = 64, NPZ_NAME = 256 };

typedef struct {
    char name[NPZ_NAME]; /* the array's name in the archive, without ".npy" */
    char kind;           /* 'f' float, 'i' signed integer, 'u' unsigned, 'b' bool */
    int item_size;       /* bytes per element */
    int rank;
    int64_t shape[NPZ_MAX_RANK];
    int64_t count;       /* elements */
    void *data;          /* C order, native little-endian, 64-byte aligned; owned by the archive */
} npz_array;

typedef struct {
    int count;
    npz_array arrays[NPZ_MAX_ARRAYS];
} npz_archive;

/* Reads every array of `path` into `archive`; 0 on success, else -1 with a message in `error`. */
int npz_read(const char *path, npz_archive *archive, char *error, size_t error_size);

/* The array called `name`, or NULL. */
npz_array *npz_find(npz_archive *archive, const char *name);

void npz_free(npz_archive *archive);

#endif
