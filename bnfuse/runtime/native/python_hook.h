/* The hook for bnfuse's Python-side ops (python_hook.c). */
#ifndef BNFUSE_PYTHON_HOOK_H
#define BNFUSE_PYTHON_HOOK_H

/* Let the Python side add its ops to ``domain``: NULL (nothing added) when it is not in this process. The Python side
 * may set *with_native to 0 (its own CPU BN kernels instead of the native ones: tests of its glue only);
 * *python_ran is set to 1 when it ran (it then registers its own convolution-gradient kernels). */
void *bnfuse_python_register(void *session_options, const void *api_base, void *domain, int *with_native,
                             int *python_ran);

#endif
