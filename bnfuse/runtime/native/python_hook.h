/* The hook for bnfuse's Python-side ops (python_hook.c). */
#ifndef BNFUSE_PYTHON_HOOK_H
#define BNFUSE_PYTHON_HOOK_H

/* Let the Python side add its ops to ``domain``: NULL (nothing added) when it is not in this process. */
void *bnfuse_python_register(void *session_options, const void *api_base, void *domain);

#endif
