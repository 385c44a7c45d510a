// The CUDA emulator's scheduler: one fiber (user-space context, own stack over a guard page) per CUDA thread.
// Blocks run one after another; inside a block a fiber runs until it reaches a barrier or a warp shuffle, or
// exits. Collectives complete only when every thread they name has arrived at the same call site, following
// the PTX definitions of bar.sync and shfl.sync; anything else (divergence, exited threads, deadlock, a memory
// fault) stops the launch with a message naming the kernel, block and thread.
#include <csetjmp>
#include <csignal>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <sys/mman.h>
#include <unistd.h>

#include <vector_types.h>

#define BNEMU_API extern "C" __attribute__((visibility("default")))

namespace bnemu {

const uint3* current_thread_idx;
uint3 block_idx, block_dim, grid_dim;
void syncthreads(const char* file, int line);
uint64_t shfl(int kind, const char* file, int line, unsigned mask, uint64_t bits, int arg, int width);

namespace {

enum State { RUNNABLE, WAIT_BARRIER, WAIT_SHFL, EXITED };
const char* const SHFL_NAMES[] = {"__shfl_down_sync", "__shfl_up_sync", "__shfl_xor_sync", "__shfl_sync"};

struct Fiber {
    void* sp;
    uint3 tid;
    int linear;
    State state;
    const char* file;  // where it waits
    int line;
    uint64_t value;
    uint64_t result;
    int arg;
};

struct WarpOp {
    bool active;
    int kind;
    const char* file;
    int line;
    unsigned mask;
    int width;
    unsigned arrived;
};

constexpr size_t STACK_BYTES = 256 * 1024;
constexpr int MAX_THREADS = 1024;

struct Launch {
    void (*entry)(void* const*);
    void* const* args;
    const char* kernel;
    int order;  // 0 forward, 1 reverse, 2 seeded random
    uint64_t rng;
    int threads;
    Fiber fibers[MAX_THREADS];
    WarpOp warps[MAX_THREADS / 32];
    int ready[MAX_THREADS];  // FIFO ring of runnable fibers
    int ready_head, ready_count;
    Fiber* current;
    void* scheduler_sp;
    int exited;
    int barrier_count;
    const char* barrier_file;
    int barrier_line;
    bool failed;
    char message[4096];
};

Launch* g_launch;
char* g_stacks;  // MAX_THREADS stacks, each above a PROT_NONE guard page
size_t g_page;
sigjmp_buf g_fault_jump;
volatile sig_atomic_t g_in_launch;
char g_fault_message[1024];
char* g_alt_stack;
void** g_shared_ptrs;  // every __shared__ variable of the module: poisoned (0xff, a NaN) before each block
size_t* g_shared_sizes;
int g_shared_count;

extern "C" void bnemu_switch(void** save_sp, void* load_sp);

#if defined(__x86_64__)
// Saves the callee-saved registers on the current stack, stores its pointer, loads the other and returns
// into it (System V x86-64).
asm(R"(
    .text
    .globl bnemu_switch
    .hidden bnemu_switch
    .type bnemu_switch, @function
bnemu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size bnemu_switch, .-bnemu_switch
)");
#else
#error "the CUDA emulator's context switch is written for x86-64"
#endif

char* stack_top(int i) { return g_stacks + (size_t)(i + 1) * (STACK_BYTES + g_page); }
char* stack_guard(int i) { return g_stacks + (size_t)i * (STACK_BYTES + g_page); }

void format_thread(char* out, size_t n, const Fiber& f) {
    snprintf(out, n, "block (%u,%u,%u) thread (%u,%u,%u)", block_idx.x, block_idx.y, block_idx.z, f.tid.x, f.tid.y,
             f.tid.z);
}

[[noreturn]] void switch_to_scheduler();

// Stops the launch: records the message (the first one wins) and returns to the scheduler for good.
[[noreturn]] __attribute__((format(printf, 1, 2))) void fail(const char* fmt, ...) {
    Launch& L = *g_launch;
    if (!L.failed) {
        L.failed = true;
        char where[128];
        format_thread(where, sizeof where, *L.current);
        int used = snprintf(L.message, sizeof L.message, "kernel %s, %s: ", L.kernel, where);
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(L.message + used, sizeof L.message - used, fmt, ap);
        va_end(ap);
    }
    switch_to_scheduler();
}

void switch_to_scheduler() {
    Launch& L = *g_launch;
    bnemu_switch(&L.current->sp, L.scheduler_sp);
    __builtin_unreachable();
}

void suspend(State state, const char* file, int line) {
    Launch& L = *g_launch;
    L.current->state = state;
    L.current->file = file;
    L.current->line = line;
    bnemu_switch(&L.current->sp, L.scheduler_sp);
}

uint64_t next_random(Launch& L) {  // xorshift64*
    L.rng ^= L.rng >> 12;
    L.rng ^= L.rng << 25;
    L.rng ^= L.rng >> 27;
    return L.rng * 2685821657736338717ULL;
}

void push_ready(Launch& L, int i) {
    L.fibers[i].state = RUNNABLE;
    L.ready[(L.ready_head + L.ready_count++) % MAX_THREADS] = i;
}

// Releases the given fibers in the launch's order (ascending, descending or shuffled).
void release(Launch& L, int* ids, int n) {
    if (L.order == 1) {
        for (int a = 0, b = n - 1; a < b; ++a, --b) {
            int t = ids[a];
            ids[a] = ids[b];
            ids[b] = t;
        }
    } else if (L.order == 2) {
        for (int a = n - 1; a > 0; --a) {
            int b = (int)(next_random(L) % (uint64_t)(a + 1));
            int t = ids[a];
            ids[a] = ids[b];
            ids[b] = t;
        }
    }
    for (int k = 0; k < n; ++k) push_ready(L, ids[k]);
}

bool same_site(const char* f1, int l1, const char* f2, int l2) { return l1 == l2 && strcmp(f1, f2) == 0; }

void on_exit_thread(Launch& L, Fiber& f) {
    ++L.exited;
    WarpOp& op = L.warps[f.linear >> 5];
    if (op.active && (op.mask >> (f.linear & 31) & 1u))
        fail("exited while lanes of its warp wait for it in %s at %s:%d (mask 0x%08x names this lane)",
             SHFL_NAMES[op.kind], op.file, op.line, op.mask);
    if (L.barrier_count > 0)
        fail("exited while %d thread(s) wait in __syncthreads at %s:%d (a barrier every thread must reach)",
             L.barrier_count, L.barrier_file, L.barrier_line);
}

void fiber_start() {
    Launch& L = *g_launch;
    L.entry(L.args);
    Fiber& f = *L.current;
    on_exit_thread(L, f);
    f.state = EXITED;
    switch_to_scheduler();
}

void init_fiber(Launch& L, int i) {
    Fiber& f = L.fibers[i];
    f.linear = i;
    f.tid.x = (unsigned)i % block_dim.x;
    f.tid.y = ((unsigned)i / block_dim.x) % block_dim.y;
    f.tid.z = (unsigned)i / (block_dim.x * block_dim.y);
    f.state = RUNNABLE;
    f.file = "";
    f.line = 0;
    void** sp = reinterpret_cast<void**>(stack_top(i));
    *--sp = nullptr;                                          // fake return address of fiber_start
    *--sp = reinterpret_cast<void*>(&fiber_start);            // bnemu_switch returns here
    for (int r = 0; r < 6; ++r) *--sp = nullptr;              // rbp rbx r12 r13 r14 r15
    f.sp = sp;
}

void describe_waits(Launch& L, char* out, size_t n) {
    size_t used = 0;
    for (int i = 0; i < L.threads && used + 128 < n; ++i) {
        Fiber& f = L.fibers[i];
        if (f.state == WAIT_BARRIER || f.state == WAIT_SHFL) {
            used += snprintf(out + used, n - used, "%sthread %d in %s at %s:%d", used ? "; " : "", i,
                             f.state == WAIT_BARRIER ? "__syncthreads" : "a shuffle", f.file, f.line);
        }
    }
}

// Runs one block to completion; false on an error (message in L.message).
bool run_block(Launch& L) {
    for (int s = 0; s < g_shared_count; ++s) memset(g_shared_ptrs[s], 0xff, g_shared_sizes[s]);
    L.ready_head = L.ready_count = 0;
    L.exited = 0;
    L.barrier_count = 0;
    memset(L.warps, 0, sizeof L.warps);
    int ids[MAX_THREADS];
    for (int i = 0; i < L.threads; ++i) {
        init_fiber(L, i);
        ids[i] = i;
    }
    release(L, ids, L.threads);
    while (L.ready_count > 0) {
        if (L.order == 2) {  // random: any runnable fiber may go next
            int k = (int)(next_random(L) % (uint64_t)L.ready_count);
            int a = L.ready_head, b = (L.ready_head + k) % MAX_THREADS;
            int t = L.ready[a];
            L.ready[a] = L.ready[b];
            L.ready[b] = t;
        }
        int i = L.ready[L.ready_head];
        L.ready_head = (L.ready_head + 1) % MAX_THREADS;
        --L.ready_count;
        L.current = &L.fibers[i];
        current_thread_idx = &L.current->tid;
        bnemu_switch(&L.scheduler_sp, L.current->sp);
        if (L.failed) return false;
    }
    if (L.exited != L.threads) {
        char waits[2048];
        describe_waits(L, waits, sizeof waits);
        snprintf(L.message, sizeof L.message, "kernel %s, block (%u,%u,%u): deadlock: %s", L.kernel, block_idx.x,
                 block_idx.y, block_idx.z, waits);
        return false;
    }
    return true;
}

void on_fault(int sig, siginfo_t* info, void*) {
    if (!g_in_launch) {
        signal(sig, SIG_DFL);
        return;  // re-executes the faulting instruction under the default action
    }
    Launch& L = *g_launch;
    const char* what = sig == SIGSEGV ? "memory fault (SIGSEGV)" : sig == SIGBUS ? "bus error (SIGBUS)"
                                                                                  : "arithmetic fault (SIGFPE)";
    char* addr = static_cast<char*>(info->si_addr);
    const char* note = "";
    if (addr >= g_stacks && addr < stack_top(MAX_THREADS - 1)) {
        size_t offset = (size_t)(addr - g_stacks) % (STACK_BYTES + g_page);
        if (offset < g_page) note = " (a thread's stack guard page: stack overflow)";
    }
    char where[128] = "scheduler";
    if (L.current) format_thread(where, sizeof where, *L.current);
    snprintf(g_fault_message, sizeof g_fault_message, "kernel %s, %s: %s at address %p%s", L.kernel, where, what,
             info->si_addr, note);
    siglongjmp(g_fault_jump, 1);
}

bool ensure_stacks() {
    if (g_stacks) return true;
    g_page = (size_t)sysconf(_SC_PAGESIZE);
    size_t total = (size_t)MAX_THREADS * (STACK_BYTES + g_page);
    void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return false;
    g_stacks = static_cast<char*>(p);
    for (int i = 0; i < MAX_THREADS; ++i) mprotect(stack_guard(i), g_page, PROT_NONE);
    g_alt_stack = static_cast<char*>(mmap(nullptr, 1 << 16, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                                          -1, 0));
    static Launch launch;
    g_launch = &launch;
    return g_alt_stack != MAP_FAILED;
}

}  // namespace

void syncthreads(const char* file, int line) {
    Launch& L = *g_launch;
    Fiber& f = *L.current;
    WarpOp& op = L.warps[f.linear >> 5];
    if (op.active && (op.mask >> (f.linear & 31) & 1u))
        fail("reached __syncthreads at %s:%d while lanes of its warp wait for it in %s at %s:%d (divergence)", file,
             line, SHFL_NAMES[op.kind], op.file, op.line);
    if (L.exited > 0)
        fail("reached __syncthreads at %s:%d after %d thread(s) of the block exited", file, line, L.exited);
    if (L.barrier_count == 0) {
        L.barrier_file = file;
        L.barrier_line = line;
    } else if (!same_site(file, line, L.barrier_file, L.barrier_line)) {
        fail("reached __syncthreads at %s:%d while %d thread(s) wait in __syncthreads at %s:%d (divergent barriers)",
             file, line, L.barrier_count, L.barrier_file, L.barrier_line);
    }
    if (++L.barrier_count == L.threads) {
        L.barrier_count = 0;
        int ids[MAX_THREADS];
        for (int i = 0; i < L.threads; ++i) ids[i] = i;
        f.state = WAIT_BARRIER;
        release(L, ids, L.threads);
        suspend(RUNNABLE, file, line);
        return;
    }
    suspend(WAIT_BARRIER, file, line);
}

uint64_t shfl(int kind, const char* file, int line, unsigned mask, uint64_t bits, int arg, int width) {
    Launch& L = *g_launch;
    Fiber& f = *L.current;
    int lane = f.linear & 31;
    int warp = f.linear >> 5;
    const char* name = SHFL_NAMES[kind];
    if (!(mask >> lane & 1u)) fail("executes %s at %s:%d with mask 0x%08x, which leaves out its own lane %d", name,
                                   file, line, mask, lane);
    if (width < 1 || width > 32 || (width & (width - 1)))
        fail("%s at %s:%d: width %d is not a power of two in 1..32", name, file, line, width);
    WarpOp& op = L.warps[warp];
    if (!op.active) {
        for (int l = 0; l < 32; ++l) {
            if (!(mask >> l & 1u)) continue;
            int t = warp * 32 + l;
            if (t >= L.threads)
                fail("%s at %s:%d: mask 0x%08x names lane %d, which does not exist (the block has %d threads; "
                     "blockDim.x %% 32 != 0?)", name, file, line, mask, l, L.threads);
            if (L.fibers[t].state == EXITED)
                fail("%s at %s:%d: mask 0x%08x names lane %d, which has exited", name, file, line, mask, l);
            if (L.fibers[t].state == WAIT_BARRIER)
                fail("%s at %s:%d: mask 0x%08x names lane %d, which waits in __syncthreads at %s:%d (divergence)",
                     name, file, line, mask, l, L.fibers[t].file, L.fibers[t].line);
        }
        op.active = true;
        op.kind = kind;
        op.file = file;
        op.line = line;
        op.mask = mask;
        op.width = width;
        op.arrived = 0;
    } else if (op.kind != kind || !same_site(file, line, op.file, op.line) || op.mask != mask || op.width != width) {
        fail("reached %s at %s:%d (mask 0x%08x) while lanes 0x%08x of its warp wait in %s at %s:%d (mask 0x%08x): "
             "divergent shuffles", name, file, line, mask, op.arrived, SHFL_NAMES[op.kind], op.file, op.line, op.mask);
    }
    f.value = bits;
    f.arg = arg;
    op.arrived |= 1u << lane;
    if (op.arrived != op.mask) {
        suspend(WAIT_SHFL, file, line);
        return f.result;
    }
    // Every named lane has arrived: shfl.sync's source lane per participating lane (PTX ISA, shfl.sync).
    int ids[32], n = 0;
    for (int l = 0; l < 32; ++l) {
        if (!(mask >> l & 1u)) continue;
        Fiber& me = L.fibers[warp * 32 + l];
        int a = me.arg, seg_start = l & ~(width - 1), seg_end = seg_start + width - 1, src = l;
        bool valid;
        switch (op.kind) {
            case 0: src = l + a; valid = a >= 0 && src <= seg_end; break;
            case 1: src = l - a; valid = a >= 0 && src >= seg_start; break;
            case 2: src = l ^ a; valid = a >= 0 && a < 32 && src <= seg_end; break;
            default: src = seg_start + (((a % width) + width) % width); valid = true; break;
        }
        if (!valid) src = l;
        if (!(mask >> src & 1u))
            fail("%s at %s:%d: lane %d reads lane %d, which is not in the mask 0x%08x (undefined on a GPU)", name,
                 file, line, l, src, mask);
        me.result = L.fibers[warp * 32 + src].value;
        ids[n++] = warp * 32 + l;
    }
    op.active = false;
    for (int k = 0; k < n; ++k) L.fibers[ids[k]].state = WAIT_SHFL;
    release(L, ids, n);
    suspend(RUNNABLE, file, line);
    return f.result;
}

}  // namespace bnemu

using namespace bnemu;

// Registers the module's __shared__ variables (found in its symbol table by cuda_emu.py).
BNEMU_API void bnemu_set_shared(void** ptrs, size_t* sizes, int count) {
    g_shared_ptrs = ptrs;
    g_shared_sizes = sizes;
    g_shared_count = count;
}

// Runs every block of a launch in order (0 forward, 1 reverse, 2 random with `seed`). Returns 0, or 1 with
// the error in `error`.
BNEMU_API int bnemu_launch(void (*entry)(void* const*), void* const* args, const char* kernel, const unsigned* grid,
                           const unsigned* block, int order, uint64_t seed, char* error, size_t error_bytes) {
    if (!ensure_stacks()) {
        snprintf(error, error_bytes, "cannot allocate fiber stacks");
        return 1;
    }
    Launch& L = *g_launch;
    L.entry = entry;
    L.args = args;
    L.kernel = kernel;
    L.order = order;
    L.rng = seed * 0x9E3779B97F4A7C15ULL + 1;
    L.failed = false;
    L.current = nullptr;
    L.message[0] = 0;
    block_dim = make_uint3(block[0], block[1], block[2]);
    grid_dim = make_uint3(grid[0], grid[1], grid[2]);
    L.threads = (int)(block[0] * block[1] * block[2]);
    if (L.threads < 1 || L.threads > MAX_THREADS) {
        snprintf(error, error_bytes, "kernel %s: %d threads per block", kernel, L.threads);
        return 1;
    }
    uint64_t blocks = (uint64_t)grid[0] * grid[1] * grid[2];
    stack_t alt = {}, old_alt = {};
    alt.ss_sp = g_alt_stack;
    alt.ss_size = 1 << 16;
    sigaltstack(&alt, &old_alt);
    struct sigaction action = {}, old_segv, old_bus, old_fpe;
    action.sa_sigaction = on_fault;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&action.sa_mask);
    sigaction(SIGSEGV, &action, &old_segv);
    sigaction(SIGBUS, &action, &old_bus);
    sigaction(SIGFPE, &action, &old_fpe);
    int status = 0;
    if (sigsetjmp(g_fault_jump, 1) == 0) {
        g_in_launch = 1;
        for (uint64_t k = 0; k < blocks; ++k) {
            uint64_t b = order == 1 ? blocks - 1 - k : k;
            if (order == 2) b = (b * 0x9E3779B1ULL + (seed % blocks)) % blocks;  // a permutation when gcd = 1
            block_idx = make_uint3((unsigned)(b % grid[0]), (unsigned)(b / grid[0] % grid[1]),
                                   (unsigned)(b / ((uint64_t)grid[0] * grid[1])));
            if (!run_block(L)) {
                snprintf(error, error_bytes, "%s", L.message);
                status = 1;
                break;
            }
        }
    } else {
        snprintf(error, error_bytes, "%s", g_fault_message);
        status = 1;
    }
    g_in_launch = 0;
    sigaction(SIGSEGV, &old_segv, nullptr);
    sigaction(SIGBUS, &old_bus, nullptr);
    sigaction(SIGFPE, &old_fpe, nullptr);
    sigaltstack(&old_alt, nullptr);
    return status;
}
