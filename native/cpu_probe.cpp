// What the CPU backend can really run here (saem_native.h: saem_cpu_amx_tiles_fault).

#include "saem_native.h"

#include "ggml-cpu.h"

#if defined(__linux__) && defined(__x86_64__)
#    include <immintrin.h>
#    include <cerrno>
#    include <csignal>
#    include <cstring>
#    include <sys/syscall.h>
#    include <sys/wait.h>
#    include <unistd.h>

// arch_prctl: ask the kernel for the AMX tile state, as ggml's AMX buffer type does
static constexpr int SAEM_ARCH_REQ_XCOMP_PERM = 0x1023;
static constexpr int SAEM_XFEATURE_XTILEDATA  = 18;

// Load a one-tile configuration, zero the tile, release: the first tile instructions ggml's AMX
// matmul runs. Compiled for AMX whatever the build's -march; only ever run in a child process.
__attribute__((target("amx-tile"))) static void touch_amx_tiles() {
    alignas(64) unsigned char config[64];
    std::memset(config, 0, sizeof(config));
    config[0]  = 1;  // palette 1
    config[16] = 64; // colsb[0]: 64 bytes per row of tile 0
    config[48] = 16; // rows[0]
    _tile_loadconfig(config);
    _tile_zero(0);
    _tile_release();
}

static int32_t probe_in_child() {
    const pid_t pid = fork();
    if (pid < 0) {
        return 0; // cannot tell: assume they work, as llama.cpp does
    }
    if (pid == 0) {
        // the parent's handlers (Python's faulthandler) must not report the child's fault
        std::signal(SIGILL, SIG_DFL);
        std::signal(SIGSEGV, SIG_DFL);
        std::signal(SIGBUS, SIG_DFL);
        syscall(SYS_arch_prctl, SAEM_ARCH_REQ_XCOMP_PERM, SAEM_XFEATURE_XTILEDATA);
        touch_amx_tiles();
        _exit(0);
    }
    int status = 0;
    while (waitpid(pid, &status, 0) < 0) {
        if (errno != EINTR) {
            return 0;
        }
    }
    return WIFEXITED(status) && WEXITSTATUS(status) == 0 ? 0 : 1;
}
#endif

extern "C" int32_t saem_cpu_amx_tiles_fault(void) {
#if defined(__linux__) && defined(__x86_64__)
    // once per process: a fork costs a few milliseconds
    static const int32_t fault = ggml_cpu_has_amx_int8() ? probe_in_child() : 0;
    return fault;
#else
    return 0;
#endif
}
