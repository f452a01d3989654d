// hip_double.cpp — a HIP runtime double for v4pool's CI: the entry points src/backend/hip
// opens from libamdhip64, over host memory, so the HIP backend's own host code (module
// loading, staging, streams, events, error paths, launch marshalling) runs where no AMD GPU
// is. Selected with V4POOL_HIP_RUNTIME=/path/to/this/library (docs/amd.md).
//
// What a real runtime would refuse, it refuses, from the facts in the real code objects:
//  * hipModuleLoadData parses the image (code_object.h): an AMDGPU ELF for this device's
//    processor, its NT_AMDGPU_METADATA kernels, each kernel's function and .kd symbols.
//  * hipModuleGetFunction of a name the metadata does not list: hipErrorNotFound.
//  * hipModuleLaunchKernel: kernarg bytes (the `extra` buffer's size, or the metadata's
//    explicit arguments read from kernelParams) equal to .kernarg_segment_size and to the
//    argument struct of the same source compiled here; block size within
//    .max_flat_workgroup_size; group segment + dynamic LDS within 64 KiB; grid within the
//    dispatch packet's 32-bit work-item counts.
// Kernels then run through the host emulation of the same source (kernels/, compiled as C++
// with V4POOL_HOST_EMULATION), on the stream's worker thread.
//
// Streams are worker threads that sleep a random (seeded) time before each operation, so a
// copy, kernel or event the backend fails to order shows up as wrong bytes, not as luck.
// Ordering is HIP's: work on one stream runs in order; streams created non-blocking do not
// order with each other or with the null stream; hipStreamSynchronize / hipEventSynchronize /
// hipDeviceSynchronize wait for what was queued before them; hipFree and hipHostFree wait for
// the device (as HIP's do). Async copies read and write host memory when they run, not when
// they are queued.
//
// hiprtc is here too (ROCm 5 shipped it inside libamdhip64, and the backend looks there): a
// compile runs a real compiler, clang 19 (V4POOL_HIP_DOUBLE_CLANG, default clang-19), on the
// source with the options given, for the arch asked (hiprtc's default: the device's), and
// hands back its code object or its diagnostics as the log.
//
// Environment: V4POOL_HIP_DOUBLE_ARCH (default gfx942:sramecc+:xnack-; gfx90a works too),
// V4POOL_HIP_DOUBLE_SEED (delay seed, default fixed), V4POOL_HIP_DOUBLE_MAX_DELAY_US (default
// 200; 0 = no delays). Every refusal is printed to stderr with its reason and kept for
// v4poolHipDoubleLastError().

#define V4POOL_HOST_EMULATION 1
#include "../../kernels/v4pool_kernels.cu"
#include "code_object.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <functional>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>
#include <unordered_map>

namespace {

// hipError_t values (hip_runtime_api.h).
enum : int {
    hipSuccess = 0,
    hipErrorInvalidValue = 1,
    hipErrorOutOfMemory = 2,
    hipErrorNotInitialized = 3,
    hipErrorInvalidDevice = 101,
    hipErrorInvalidImage = 200,
    hipErrorInvalidContext = 201,
    hipErrorNoBinaryForGpu = 209,
    hipErrorInvalidHandle = 400,
    hipErrorNotFound = 500,
    hipErrorNotReady = 600,
    hipErrorLaunchOutOfResources = 701,
};

constexpr unsigned kNonBlocking = 1;
constexpr unsigned kDisableTiming = 2;
constexpr uint64_t kLdsBytes = 64 * 1024;  // gfx90a and gfx942: 64 KiB LDS per workgroup
constexpr size_t kPropBytes = 1472;        // hipDeviceProp_tR0600 on x86-64
constexpr size_t kArchOffset = 1160;       // its gcnArchName[256]

thread_local std::string g_last_error;
thread_local int g_device = 0;
bool g_initialised = false;

int fail(int code, const std::string& why) {
    g_last_error = why;
    std::fprintf(stderr, "[hip double] %s\n", why.c_str());
    return code;
}

std::string env_or(const char* name, const char* fallback) {
    const char* v = std::getenv(name);
    return v && *v ? std::string(v) : std::string(fallback);
}

const std::string& device_arch() {
    static const std::string arch = env_or("V4POOL_HIP_DOUBLE_ARCH", "gfx942:sramecc+:xnack-");
    return arch;
}

// ---- the kernels of kernels/, as the emulation runs them --------------------------------

struct HostKernel {
    const char* name;
    size_t arg_bytes;  // sizeof the argument struct this compile of the source sees
    std::function<void(const std::vector<uint8_t>&, const unsigned*, unsigned)> run;
};

const std::vector<HostKernel>& host_kernels() {
#define V4P_HOST_KERNEL(fn, Args) \
    HostKernel{#fn, sizeof(Args), [](const std::vector<uint8_t>& a, const unsigned* g, unsigned t) { v4p_emu_run<Args>(fn, a.data(), g, t); }}
    static const std::vector<HostKernel> table = {
        V4P_HOST_KERNEL(v4pool_decode_indices, DecodeIndexArgs),
        V4P_HOST_KERNEL(v4pool_prefill_indices, PrefillIndexArgs),
        V4P_HOST_KERNEL(v4pool_prefill_indices_short, PrefillIndexArgs),
        V4P_HOST_KERNEL(v4pool_prefill_indices_pair, PrefillIndexArgs),
        V4P_HOST_KERNEL(v4pool_hca_offsets, HcaOffsetsArgs),
        V4P_HOST_KERNEL(v4pool_csa_translate_pack, CsaPackArgs),
        V4P_HOST_KERNEL(v4pool_csa_translate_pack_staged, CsaPackArgs),
        V4P_HOST_KERNEL(v4pool_csa_translate_pack_staged_x4, CsaPackArgs),
        V4P_HOST_KERNEL(v4pool_ring_write, RingWriteArgs),
        V4P_HOST_KERNEL(v4pool_row_scatter, RowScatterArgs),
        V4P_HOST_KERNEL(v4pool_update_compressor_states, StateUpdateArgs),
        V4P_HOST_KERNEL(v4pool_fill_runs, FillRunsArgs),
        V4P_HOST_KERNEL(v4pool_copy_runs, CopyRunsArgs),
        V4P_HOST_KERNEL(v4pool_window_gather, WindowGatherArgs),
        V4P_HOST_KERNEL(v4pool_window_gather_fp8, WindowGatherArgs),
        V4P_HOST_KERNEL(v4pool_kv_rows, KvRowsArgs),
        V4P_HOST_KERNEL(v4pool_index_keys, IndexKeysArgs),
        V4P_HOST_KERNEL(v4pool_write_batch, WriteBatchArgs),
        HostKernel{"v4pool_empty", 0, [](const std::vector<uint8_t>&, const unsigned*, unsigned) {}},
    };
#undef V4P_HOST_KERNEL
    return table;
}

const HostKernel* host_kernel(const std::string& name) {
    for (const auto& k : host_kernels())
        if (name == k.name) return &k;
    return nullptr;
}

// ---- streams -------------------------------------------------------------------------------

class Stream {
  public:
    Stream(unsigned flags, uint64_t seed) : flags_(flags), rng_(seed | 1) { worker_ = std::thread([this] { loop(); }); }
    ~Stream() {
        {
            std::lock_guard<std::mutex> l(m_);
            stop_ = true;
        }
        cv_.notify_all();
        worker_.join();  // runs what is queued first, as HIP does before it destroys a stream
    }
    void push(std::function<void()> op) {
        {
            std::lock_guard<std::mutex> l(m_);
            q_.push_back(std::move(op));
        }
        cv_.notify_all();
    }
    void drain() {
        std::unique_lock<std::mutex> l(m_);
        idle_.wait(l, [&] { return q_.empty() && !busy_; });
    }
    unsigned flags() const { return flags_; }

  private:
    void loop() {
        for (;;) {
            std::function<void()> op;
            {
                std::unique_lock<std::mutex> l(m_);
                cv_.wait(l, [&] { return stop_ || !q_.empty(); });
                if (q_.empty()) return;  // stop_ and nothing left
                op = std::move(q_.front());
                q_.pop_front();
                busy_ = true;
            }
            delay();
            op();
            {
                std::lock_guard<std::mutex> l(m_);
                busy_ = false;
            }
            idle_.notify_all();
        }
    }
    void delay() {
        static const long max_us = std::strtol(env_or("V4POOL_HIP_DOUBLE_MAX_DELAY_US", "200").c_str(), nullptr, 10);
        if (max_us <= 0) return;
        // xorshift64: one sequence per stream, from the process seed and the stream's number.
        rng_ ^= rng_ << 13, rng_ ^= rng_ >> 7, rng_ ^= rng_ << 17;
        if (rng_ % 4 != 0) return;  // a quarter of the operations wait, the rest run at once
        std::this_thread::sleep_for(std::chrono::microseconds((rng_ >> 8) % uint64_t(max_us)));
    }
    unsigned flags_;
    uint64_t rng_;
    std::mutex m_;
    std::condition_variable cv_, idle_;
    std::deque<std::function<void()>> q_;
    bool busy_ = false, stop_ = false;
    std::thread worker_;
};

struct Event {
    unsigned flags = 0;
    std::mutex m;
    std::condition_variable cv;
    uint64_t recorded = 0, completed = 0;
    std::chrono::steady_clock::time_point at;
};

struct Function {
    hipdbl::KernelInfo info;
    const HostKernel* host;
};

struct Module {
    std::map<std::string, std::unique_ptr<Function>> functions;
};

// Every live handle and allocation, so a stale or foreign one is an error, not a crash.
struct Registry {
    std::mutex m;
    std::unordered_map<void*, std::shared_ptr<Stream>> streams;
    std::unordered_map<void*, std::shared_ptr<Event>> events;
    std::unordered_map<void*, std::unique_ptr<Module>> modules;
    std::unordered_map<void*, Function*> functions;
    std::map<uintptr_t, size_t> device;  // base -> bytes
    std::map<uintptr_t, size_t> pinned;
    uint64_t streams_made = 0;
};

Registry& reg() {
    static Registry* r = new Registry;  // never destroyed: worker threads may outlive statics
    return *r;
}

uint64_t seed() {
    static const uint64_t s = std::strtoull(env_or("V4POOL_HIP_DOUBLE_SEED", "24301").c_str(), nullptr, 10);
    return s;
}

std::shared_ptr<Stream> null_stream() {
    static std::shared_ptr<Stream>* s = new std::shared_ptr<Stream>(std::make_shared<Stream>(0, seed() ^ 0x9e3779b97f4a7c15ull));
    return *s;
}

/// The stream a handle names (null: the null stream), or nullptr for an unknown handle.
std::shared_ptr<Stream> stream_of(void* handle) {
    if (!handle) return null_stream();
    std::lock_guard<std::mutex> l(reg().m);
    auto it = reg().streams.find(handle);
    return it == reg().streams.end() ? nullptr : it->second;
}

/// Whether [p, p + len) lies inside one live allocation of `table`.
bool inside(const std::map<uintptr_t, size_t>& table, const void* p, size_t len) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    auto it = table.upper_bound(a);
    if (it == table.begin()) return false;
    --it;
    return a - it->first <= it->second && len <= it->second - (a - it->first);
}

bool device_range(const void* p, size_t len) {
    std::lock_guard<std::mutex> l(reg().m);
    return inside(reg().device, p, len);
}

void device_synchronize() {
    std::vector<std::shared_ptr<Stream>> all{null_stream()};
    {
        std::lock_guard<std::mutex> l(reg().m);
        for (auto& [h, s] : reg().streams) all.push_back(s);
    }
    for (auto& s : all) s->drain();
}

std::string hex(const void* p) {
    char b[32];
    std::snprintf(b, sizeof b, "%p", p);
    return b;
}

int copy_async(void* dst, const void* src, size_t n, void* stream, bool dst_dev, bool src_dev, const char* call) {
    auto s = stream_of(stream);
    if (!s) return fail(hipErrorInvalidHandle, std::string(call) + ": unknown stream " + hex(stream));
    if (n == 0) return hipSuccess;
    if (!dst || !src) return fail(hipErrorInvalidValue, std::string(call) + ": null pointer");
    if (dst_dev && !device_range(dst, n))
        return fail(hipErrorInvalidValue, std::string(call) + ": destination " + hex(dst) + " + " + std::to_string(n) + " is not inside one hipMalloc allocation");
    if (src_dev && !device_range(src, n))
        return fail(hipErrorInvalidValue, std::string(call) + ": source " + hex(src) + " + " + std::to_string(n) + " is not inside one hipMalloc allocation");
    const uintptr_t d = reinterpret_cast<uintptr_t>(dst), sr = reinterpret_cast<uintptr_t>(src);
    if (d < sr + n && sr < d + n) return fail(hipErrorInvalidValue, std::string(call) + ": source and destination overlap");
    s->push([dst, src, n] { std::memcpy(dst, src, n); });
    return hipSuccess;
}

}  // namespace

// ---- the exported runtime --------------------------------------------------------------------

extern "C" {

/// The reason for the calling thread's most recent refusal (empty if none): the double's own
/// entry point, for tests that assert which check fired.
const char* v4poolHipDoubleLastError() { return g_last_error.c_str(); }

int hipInit(unsigned flags) {
    if (flags != 0) return fail(hipErrorInvalidValue, "hipInit: flags must be 0");
    if (hipdbl::mach_of_arch(device_arch()) == 0)
        return fail(hipErrorInvalidValue, "V4POOL_HIP_DOUBLE_ARCH=" + device_arch() + ": the double knows gfx942 and gfx90a");
    g_initialised = true;
    return hipSuccess;
}

int hipGetDeviceCount(int* count) {
    if (!count) return fail(hipErrorInvalidValue, "hipGetDeviceCount: null");
    *count = 1;
    return hipSuccess;
}

int hipSetDevice(int ordinal) {
    if (ordinal != 0) return fail(hipErrorInvalidDevice, "hipSetDevice: no device " + std::to_string(ordinal));
    g_device = ordinal;
    return hipSuccess;
}

int hipDeviceGet(int* device, int ordinal) {
    if (!device) return fail(hipErrorInvalidValue, "hipDeviceGet: null");
    if (ordinal != 0) return fail(hipErrorInvalidDevice, "hipDeviceGet: no device " + std::to_string(ordinal));
    *device = ordinal;
    return hipSuccess;
}

int hipDeviceGetName(char* name, int len, int device) {
    if (!name || len <= 0) return fail(hipErrorInvalidValue, "hipDeviceGetName: no buffer");
    if (device != 0) return fail(hipErrorInvalidDevice, "hipDeviceGetName: no device " + std::to_string(device));
    std::snprintf(name, size_t(len), "v4pool HIP runtime double (%s, host memory)", device_arch().c_str());
    return hipSuccess;
}

int hipGetDevicePropertiesR0600(void* prop, int device) {
    if (!prop) return fail(hipErrorInvalidValue, "hipGetDevicePropertiesR0600: null");
    if (device != 0) return fail(hipErrorInvalidDevice, "hipGetDevicePropertiesR0600: no device");
    // Only the struct's own bytes are written, as the real runtime does.
    std::memset(prop, 0, kPropBytes);
    std::snprintf(static_cast<char*>(prop), 256, "v4pool HIP runtime double");
    std::snprintf(static_cast<char*>(prop) + kArchOffset, 256, "%s", device_arch().c_str());
    return hipSuccess;
}

const char* hipGetErrorString(int code) {
    switch (code) {
        case hipSuccess: return "hipSuccess";
        case hipErrorInvalidValue: return "hipErrorInvalidValue";
        case hipErrorOutOfMemory: return "hipErrorOutOfMemory";
        case hipErrorNotInitialized: return "hipErrorNotInitialized";
        case hipErrorInvalidDevice: return "hipErrorInvalidDevice";
        case hipErrorInvalidImage: return "hipErrorInvalidImage";
        case hipErrorInvalidContext: return "hipErrorInvalidContext";
        case hipErrorNoBinaryForGpu: return "hipErrorNoBinaryForGpu";
        case hipErrorInvalidHandle: return "hipErrorInvalidHandle";
        case hipErrorNotFound: return "hipErrorNotFound";
        case hipErrorNotReady: return "hipErrorNotReady";
        case hipErrorLaunchOutOfResources: return "hipErrorLaunchOutOfResources";
        default: return "hipErrorUnknown";
    }
}

// -- memory --

int hipMalloc(void** ptr, size_t size) {
    if (!ptr) return fail(hipErrorInvalidValue, "hipMalloc: null");
    if (size == 0) {
        *ptr = nullptr;
        return hipSuccess;
    }
    if (size > (size_t(1) << 40)) return fail(hipErrorOutOfMemory, "hipMalloc: " + std::to_string(size) + " bytes");
    // 256-byte aligned like the device allocator; poisoned, as device memory is not zeroed.
    void* p = std::aligned_alloc(256, (size + 255) / 256 * 256);
    if (!p) return fail(hipErrorOutOfMemory, "hipMalloc: host memory exhausted");
    std::memset(p, 0xa5, size);
    std::lock_guard<std::mutex> l(reg().m);
    reg().device[reinterpret_cast<uintptr_t>(p)] = size;
    *ptr = p;
    return hipSuccess;
}

int hipFree(void* ptr) {
    if (!ptr) return hipSuccess;
    device_synchronize();  // hipFree waits for the device
    std::lock_guard<std::mutex> l(reg().m);
    if (!reg().device.erase(reinterpret_cast<uintptr_t>(ptr)))
        return fail(hipErrorInvalidValue, "hipFree: " + hex(ptr) + " is not a live hipMalloc allocation");
    std::free(ptr);
    return hipSuccess;
}

int hipHostMalloc(void** ptr, size_t size, unsigned flags) {
    if (!ptr) return fail(hipErrorInvalidValue, "hipHostMalloc: null");
    if (flags != 0) return fail(hipErrorInvalidValue, "hipHostMalloc: the double takes flags 0 only");
    void* p = std::aligned_alloc(4096, (std::max<size_t>(size, 1) + 4095) / 4096 * 4096);
    if (!p) return fail(hipErrorOutOfMemory, "hipHostMalloc: host memory exhausted");
    std::lock_guard<std::mutex> l(reg().m);
    reg().pinned[reinterpret_cast<uintptr_t>(p)] = size;
    *ptr = p;
    return hipSuccess;
}

int hipHostFree(void* ptr) {
    if (!ptr) return hipSuccess;
    device_synchronize();  // as hipFree
    std::lock_guard<std::mutex> l(reg().m);
    if (!reg().pinned.erase(reinterpret_cast<uintptr_t>(ptr)))
        return fail(hipErrorInvalidValue, "hipHostFree: " + hex(ptr) + " is not a live hipHostMalloc buffer");
    std::free(ptr);
    return hipSuccess;
}

int hipMemsetAsync(void* dst, int value, size_t n, void* stream) {
    auto s = stream_of(stream);
    if (!s) return fail(hipErrorInvalidHandle, "hipMemsetAsync: unknown stream");
    if (n == 0) return hipSuccess;
    if (!device_range(dst, n)) return fail(hipErrorInvalidValue, "hipMemsetAsync: " + hex(dst) + " + " + std::to_string(n) + " is not inside one allocation");
    s->push([dst, value, n] { std::memset(dst, value & 0xff, n); });
    return hipSuccess;
}

int hipMemsetD32Async(void* dst, int value, size_t count, void* stream) {
    auto s = stream_of(stream);
    if (!s) return fail(hipErrorInvalidHandle, "hipMemsetD32Async: unknown stream");
    if (count == 0) return hipSuccess;
    if (reinterpret_cast<uintptr_t>(dst) % 4 != 0) return fail(hipErrorInvalidValue, "hipMemsetD32Async: destination not 4-byte aligned");
    if (count > SIZE_MAX / 4 || !device_range(dst, count * 4))
        return fail(hipErrorInvalidValue, "hipMemsetD32Async: " + hex(dst) + " + " + std::to_string(count) + " words is not inside one allocation");
    s->push([dst, value, count] {
        for (size_t i = 0; i < count; ++i) std::memcpy(static_cast<char*>(dst) + 4 * i, &value, 4);
    });
    return hipSuccess;
}

int hipMemcpyHtoDAsync(void* dst, void* src, size_t n, void* stream) {
    return copy_async(dst, src, n, stream, true, false, "hipMemcpyHtoDAsync");
}
int hipMemcpyDtoHAsync(void* dst, void* src, size_t n, void* stream) {
    return copy_async(dst, src, n, stream, false, true, "hipMemcpyDtoHAsync");
}
int hipMemcpyDtoDAsync(void* dst, void* src, size_t n, void* stream) {
    return copy_async(dst, src, n, stream, true, true, "hipMemcpyDtoDAsync");
}

// -- streams and events --

int hipStreamCreateWithFlags(void** stream, unsigned flags) {
    if (!stream) return fail(hipErrorInvalidValue, "hipStreamCreateWithFlags: null");
    if (flags & ~kNonBlocking) return fail(hipErrorInvalidValue, "hipStreamCreateWithFlags: unknown flags");
    if (!(flags & kNonBlocking))
        // A blocking stream orders with the null stream; the backend never asks for one, and
        // the double would have to model that ordering to hand one out.
        return fail(hipErrorInvalidValue, "hipStreamCreateWithFlags: the double hands out non-blocking streams only");
    std::lock_guard<std::mutex> l(reg().m);
    auto s = std::make_shared<Stream>(flags, seed() * 0x100000001b3ull + ++reg().streams_made);
    *stream = s.get();
    reg().streams[s.get()] = s;
    return hipSuccess;
}

int hipStreamDestroy(void* stream) {
    std::shared_ptr<Stream> s;
    {
        std::lock_guard<std::mutex> l(reg().m);
        auto it = reg().streams.find(stream);
        if (it == reg().streams.end()) return fail(hipErrorInvalidHandle, "hipStreamDestroy: unknown stream " + hex(stream));
        s = std::move(it->second);
        reg().streams.erase(it);
    }
    s.reset();  // the last owner joins the worker once its queue has run
    return hipSuccess;
}

int hipStreamSynchronize(void* stream) {
    auto s = stream_of(stream);
    if (!s) return fail(hipErrorInvalidHandle, "hipStreamSynchronize: unknown stream " + hex(stream));
    s->drain();
    return hipSuccess;
}

int hipDeviceSynchronize() {
    device_synchronize();
    return hipSuccess;
}

int hipEventCreateWithFlags(void** event, unsigned flags) {
    if (!event) return fail(hipErrorInvalidValue, "hipEventCreateWithFlags: null");
    if (flags & ~kDisableTiming) return fail(hipErrorInvalidValue, "hipEventCreateWithFlags: flags the double does not model");
    auto e = std::make_shared<Event>();
    e->flags = flags;
    std::lock_guard<std::mutex> l(reg().m);
    *event = e.get();
    reg().events[e.get()] = e;
    return hipSuccess;
}

int hipEventCreate(void** event) { return hipEventCreateWithFlags(event, 0); }

static std::shared_ptr<Event> event_of(void* handle) {
    std::lock_guard<std::mutex> l(reg().m);
    auto it = reg().events.find(handle);
    return it == reg().events.end() ? nullptr : it->second;
}

int hipEventDestroy(void* event) {
    std::lock_guard<std::mutex> l(reg().m);
    // A pending record keeps its own reference: destruction waits for it, as HIP's does.
    if (!reg().events.erase(event)) return fail(hipErrorInvalidHandle, "hipEventDestroy: unknown event " + hex(event));
    return hipSuccess;
}

int hipEventRecord(void* event, void* stream) {
    auto e = event_of(event);
    if (!e) return fail(hipErrorInvalidHandle, "hipEventRecord: unknown event " + hex(event));
    auto s = stream_of(stream);
    if (!s) return fail(hipErrorInvalidHandle, "hipEventRecord: unknown stream " + hex(stream));
    uint64_t generation;
    {
        std::lock_guard<std::mutex> l(e->m);
        generation = ++e->recorded;
    }
    s->push([e, generation] {
        {
            std::lock_guard<std::mutex> l(e->m);
            if (generation > e->completed) e->completed = generation, e->at = std::chrono::steady_clock::now();
        }
        e->cv.notify_all();
    });
    return hipSuccess;
}

int hipEventQuery(void* event) {
    auto e = event_of(event);
    if (!e) return fail(hipErrorInvalidHandle, "hipEventQuery: unknown event " + hex(event));
    std::lock_guard<std::mutex> l(e->m);
    return e->completed == e->recorded ? hipSuccess : hipErrorNotReady;
}

int hipEventSynchronize(void* event) {
    auto e = event_of(event);
    if (!e) return fail(hipErrorInvalidHandle, "hipEventSynchronize: unknown event " + hex(event));
    std::unique_lock<std::mutex> l(e->m);
    const uint64_t target = e->recorded;  // the record most recent at the call
    e->cv.wait(l, [&] { return e->completed >= target; });
    return hipSuccess;
}

int hipEventElapsedTime(float* ms, void* start, void* end) {
    if (!ms) return fail(hipErrorInvalidValue, "hipEventElapsedTime: null");
    auto a = event_of(start), b = event_of(end);
    if (!a || !b) return fail(hipErrorInvalidHandle, "hipEventElapsedTime: unknown event");
    if ((a->flags | b->flags) & kDisableTiming)
        return fail(hipErrorInvalidHandle, "hipEventElapsedTime: an event was created with hipEventDisableTiming");
    std::chrono::steady_clock::time_point ta, tb;
    for (auto [e, t] : {std::make_pair(a.get(), &ta), std::make_pair(b.get(), &tb)}) {
        std::lock_guard<std::mutex> l(e->m);
        if (e->recorded == 0) return fail(hipErrorInvalidHandle, "hipEventElapsedTime: an event was never recorded");
        if (e->completed != e->recorded) return hipErrorNotReady;
        *t = e->at;
    }
    *ms = std::chrono::duration<float, std::milli>(tb - ta).count();
    return hipSuccess;
}

// -- modules and launches --

int hipModuleLoadData(void** module, const void* image) {
    if (!module || !image) return fail(hipErrorInvalidValue, "hipModuleLoadData: null");
    if (!g_initialised) return fail(hipErrorNotInitialized, "hipModuleLoadData before hipInit");
    // hipModuleLoadData takes no size: the image's extent comes from its own headers. Read the
    // ELF header (or the bundle's) first, then bound every read by the extent it declares.
    const uint8_t* p = static_cast<const uint8_t*>(image);
    size_t extent;
    if (std::memcmp(p, "__CLANG_OFFLOAD_BUNDLE__", 24) == 0) {
        uint64_t n, end = 32;
        std::memcpy(&n, p + 24, 8);
        if (n > 64) return fail(hipErrorInvalidImage, "hipModuleLoadData: offload bundle with too many entries");
        size_t at = 32;
        for (uint64_t i = 0; i < n; ++i) {
            uint64_t off, size, idlen;
            std::memcpy(&off, p + at, 8), std::memcpy(&size, p + at + 8, 8), std::memcpy(&idlen, p + at + 16, 8);
            if (idlen > 4096 || off > (1ull << 32) || size > (1ull << 32))
                return fail(hipErrorInvalidImage, "hipModuleLoadData: implausible offload bundle entry");
            at += 24 + idlen;
            end = std::max<uint64_t>({end, at, off + size});
        }
        extent = end;
    } else if (std::memcmp(p, "\x7f" "ELF", 4) == 0 && p[4] == 2) {
        uint64_t shoff;
        uint16_t shnum;
        std::memcpy(&shoff, p + 40, 8), std::memcpy(&shnum, p + 60, 2);
        if (shoff > (1ull << 32)) return fail(hipErrorInvalidImage, "hipModuleLoadData: implausible e_shoff");
        extent = shoff + uint64_t(shnum) * 64;
        // Sections lie before the header table in what lld writes; take the furthest end.
        for (uint16_t i = 0; i < shnum; ++i) {
            uint64_t off, size;
            uint32_t type;
            std::memcpy(&type, p + shoff + i * 64 + 4, 4);
            std::memcpy(&off, p + shoff + i * 64 + 24, 8), std::memcpy(&size, p + shoff + i * 64 + 32, 8);
            if (type != 8 /* SHT_NOBITS */ && off <= (1ull << 32) && size <= (1ull << 32)) extent = std::max<uint64_t>(extent, off + size);
        }
    } else {
        return fail(hipErrorInvalidImage, "hipModuleLoadData: neither an ELF code object nor an offload bundle");
    }
    hipdbl::CodeObject co;
    try {
        co = hipdbl::parse_code_object(p, extent);
    } catch (const hipdbl::CodeObjectError& e) {
        return fail(hipErrorInvalidImage, "hipModuleLoadData: " + e.message);
    }
    const uint32_t want = hipdbl::mach_of_arch(device_arch());
    if (co.mach() != want) {
        char b[160];
        std::snprintf(b, sizeof b, "hipModuleLoadData: code object for processor 0x%x, the device is %s (0x%x)", co.mach(),
                      device_arch().c_str(), want);
        return fail(hipErrorNoBinaryForGpu, b);
    }
    if (co.abi_version < 2) return fail(hipErrorInvalidImage, "hipModuleLoadData: code object older than v4");
    auto m = std::make_unique<Module>();
    for (auto& [name, info] : co.kernels) {
        if (info.wavefront_size != 64)
            return fail(hipErrorInvalidImage, "hipModuleLoadData: kernel " + name + " built for wave" + std::to_string(info.wavefront_size) + ", gfx9 runs wave64");
        m->functions[name] = std::make_unique<Function>(Function{info, host_kernel(name)});
    }
    std::lock_guard<std::mutex> l(reg().m);
    void* handle = m.get();
    reg().modules[handle] = std::move(m);
    *module = handle;
    return hipSuccess;
}

int hipModuleUnload(void* module) {
    device_synchronize();
    std::lock_guard<std::mutex> l(reg().m);
    auto it = reg().modules.find(module);
    if (it == reg().modules.end()) return fail(hipErrorInvalidHandle, "hipModuleUnload: unknown module");
    for (auto& [name, f] : it->second->functions) reg().functions.erase(f.get());
    reg().modules.erase(it);
    return hipSuccess;
}

int hipModuleGetFunction(void** function, void* module, const char* name) {
    if (!function || !name) return fail(hipErrorInvalidValue, "hipModuleGetFunction: null");
    std::lock_guard<std::mutex> l(reg().m);
    auto it = reg().modules.find(module);
    if (it == reg().modules.end()) return fail(hipErrorInvalidHandle, "hipModuleGetFunction: unknown module");
    auto f = it->second->functions.find(name);
    if (f == it->second->functions.end())
        return fail(hipErrorNotFound, std::string("hipModuleGetFunction: the code object has no kernel ") + name);
    if (!f->second->host)
        return fail(hipErrorNotFound, std::string("hipModuleGetFunction: kernel ") + name + " is in the code object but not in the double's host emulation table");
    reg().functions[f->second.get()] = f->second.get();
    *function = f->second.get();
    return hipSuccess;
}

int hipModuleLaunchKernel(void* function, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                          unsigned shared_bytes, void* stream, void** params, void** extra) {
    Function* f;
    {
        std::lock_guard<std::mutex> l(reg().m);
        auto it = reg().functions.find(function);
        if (it == reg().functions.end()) return fail(hipErrorInvalidHandle, "hipModuleLaunchKernel: unknown function " + hex(function));
        f = it->second;
    }
    const hipdbl::KernelInfo& k = f->info;
    const std::string who = "hipModuleLaunchKernel(" + k.name + "): ";
    auto s = stream_of(stream);
    if (!s) return fail(hipErrorInvalidHandle, who + "unknown stream " + hex(stream));
    if (!gx || !gy || !gz || !bx || !by || !bz) return fail(hipErrorInvalidValue, who + "a grid or block dimension is 0");
    const uint64_t block = uint64_t(bx) * by * bz;
    if (block > k.max_flat_workgroup_size)
        return fail(hipErrorInvalidValue, who + "block " + std::to_string(bx) + "x" + std::to_string(by) + "x" + std::to_string(bz) +
                                              " exceeds the kernel's .max_flat_workgroup_size " + std::to_string(k.max_flat_workgroup_size));
    if (by != 1 || bz != 1)
        return fail(hipErrorInvalidValue, who + "block y/z above 1: every v4pool kernel indexes threads in x only");
    // The dispatch packet counts work-items in 32 bits per dimension.
    for (auto [g, b] : {std::make_pair(gx, bx), std::make_pair(gy, by), std::make_pair(gz, bz)})
        if (uint64_t(g) * b > 0xffffffffull) return fail(hipErrorInvalidValue, who + "grid exceeds 2^32 work-items in a dimension");
    if (k.group_segment_fixed_size + shared_bytes > kLdsBytes)
        return fail(hipErrorInvalidValue, who + "dynamic LDS " + std::to_string(shared_bytes) + " B + the kernel's group segment " +
                                              std::to_string(k.group_segment_fixed_size) + " B exceeds 64 KiB");
    // The kernarg segment, as the runtime builds it.
    std::vector<uint8_t> kernarg(k.kernarg_segment_size, 0);
    const uint64_t explicit_bytes = k.explicit_bytes();
    if (explicit_bytes != k.kernarg_segment_size)
        return fail(hipErrorInvalidImage, who + "the kernel has hidden arguments (" + std::to_string(k.kernarg_segment_size - explicit_bytes) +
                                              " B) the double does not fill");
    if (params && extra) return fail(hipErrorInvalidValue, who + "both kernelParams and extra given");
    if (extra) {
        // HIP_LAUNCH_PARAM_BUFFER_POINTER (1), _SIZE (2), _END (3).
        void* buf = nullptr;
        size_t* size = nullptr;
        for (int i = 0; i < 16 && extra[i] != reinterpret_cast<void*>(3); i += 2) {
            if (extra[i] == reinterpret_cast<void*>(1)) buf = extra[i + 1];
            else if (extra[i] == reinterpret_cast<void*>(2)) size = static_cast<size_t*>(extra[i + 1]);
            else return fail(hipErrorInvalidValue, who + "unknown key in extra");
        }
        if (!buf || !size) return fail(hipErrorInvalidValue, who + "extra lacks the buffer pointer or size");
        if (*size != k.kernarg_segment_size)
            return fail(hipErrorInvalidValue, who + "kernarg bytes " + std::to_string(*size) + " != the kernel's .kernarg_segment_size " +
                                                  std::to_string(k.kernarg_segment_size));
        std::memcpy(kernarg.data(), buf, *size);
    } else if (k.explicit_count() > 0) {
        if (!params) return fail(hipErrorInvalidValue, who + "the kernel takes " + std::to_string(k.explicit_count()) + " argument(s), none given");
        size_t i = 0;
        for (const auto& a : k.args) {
            if (a.hidden()) continue;
            if (!params[i]) return fail(hipErrorInvalidValue, who + "kernelParams[" + std::to_string(i) + "] is null");
            std::memcpy(kernarg.data() + a.offset, params[i], a.size);
            ++i;
        }
    } else if (params && params[0]) {
        // hipModuleLaunchKernel would ignore them; a caller passing arguments to a kernel that
        // takes none has the wrong kernel.
        return fail(hipErrorInvalidValue, who + "arguments given to a kernel that takes none");
    }
    // The code object and this compile of the same source agree on the argument struct.
    if (f->host->arg_bytes != k.kernarg_segment_size)
        return fail(hipErrorInvalidImage, who + ".kernarg_segment_size " + std::to_string(k.kernarg_segment_size) +
                                              " != the argument struct's " + std::to_string(f->host->arg_bytes) + " B in the host compile");
    const HostKernel* host = f->host;
    const unsigned grid[3] = {gx, gy, gz};
    s->push([host, kernarg = std::move(kernarg), grid0 = grid[0], grid1 = grid[1], grid2 = grid[2], bx] {
        const unsigned g[3] = {grid0, grid1, grid2};
        host->run(kernarg, g, bx);
    });
    return hipSuccess;
}

}  // extern "C"

// ---- hiprtc, over a real clang ---------------------------------------------------------------

namespace {

struct RtcProgram {
    std::string source, name, log;
    std::vector<char> code;
};

enum : int {
    HIPRTC_SUCCESS = 0,
    HIPRTC_ERROR_INVALID_INPUT = 3,
    HIPRTC_ERROR_INVALID_PROGRAM = 4,
    HIPRTC_ERROR_COMPILATION = 6,
    HIPRTC_ERROR_INTERNAL_ERROR = 11,
};

std::mutex g_rtc_m;
std::map<void*, std::unique_ptr<RtcProgram>> g_rtc;

RtcProgram* program_of(void* p) {
    std::lock_guard<std::mutex> l(g_rtc_m);
    auto it = g_rtc.find(p);
    return it == g_rtc.end() ? nullptr : it->second.get();
}

std::string slurp(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    std::ostringstream o;
    o << f.rdbuf();
    return o.str();
}

/// Run `argv` (no shell), stderr and stdout to `log_path`; the exit status, or -1.
int run_tool(const std::vector<std::string>& argv, const std::string& log_path) {
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    pid_t pid;
    const int rc = posix_spawnp(&pid, args[0], &fa, nullptr, args.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) return -1;
    int status = 0;
    if (waitpid(pid, &status, 0) != pid) return -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace

extern "C" {

const char* hiprtcGetErrorString(int code) {
    switch (code) {
        case HIPRTC_SUCCESS: return "HIPRTC_SUCCESS";
        case HIPRTC_ERROR_INVALID_INPUT: return "HIPRTC_ERROR_INVALID_INPUT";
        case HIPRTC_ERROR_INVALID_PROGRAM: return "HIPRTC_ERROR_INVALID_PROGRAM";
        case HIPRTC_ERROR_COMPILATION: return "HIPRTC_ERROR_COMPILATION";
        default: return "HIPRTC_ERROR_INTERNAL_ERROR";
    }
}

int hiprtcCreateProgram(void** prog, const char* src, const char* name, int num_headers, const char** headers, const char** names) {
    if (!prog || !src) return HIPRTC_ERROR_INVALID_INPUT;
    if (num_headers != 0) return fail(HIPRTC_ERROR_INVALID_INPUT, "hiprtcCreateProgram: the double takes no headers");
    auto p = std::make_unique<RtcProgram>();
    p->source = src;
    p->name = name ? name : "program.hip";
    std::lock_guard<std::mutex> l(g_rtc_m);
    *prog = p.get();
    g_rtc[p.get()] = std::move(p);
    return HIPRTC_SUCCESS;
}

int hiprtcCompileProgram(void* prog, int num_options, const char** options) {
    RtcProgram* p = program_of(prog);
    if (!p) return HIPRTC_ERROR_INVALID_PROGRAM;
    if (num_options < 0 || (num_options > 0 && !options)) return HIPRTC_ERROR_INVALID_INPUT;
    std::string arch;
    std::vector<std::string> extra;
    for (int i = 0; i < num_options; ++i) {
        if (!options[i]) return HIPRTC_ERROR_INVALID_INPUT;
        const std::string o = options[i];
        if (o.rfind("--offload-arch=", 0) == 0) arch = o.substr(15);
        else extra.push_back(o);
    }
    if (arch.empty()) arch = device_arch().substr(0, device_arch().find(':'));
    char dir_template[] = "/tmp/v4pool-hiprtc-XXXXXX";
    if (!mkdtemp(dir_template)) return HIPRTC_ERROR_INTERNAL_ERROR;
    const std::string dir = dir_template, src = dir + "/source.hip", out = dir + "/code.o", log = dir + "/log.txt";
    {
        std::ofstream f(src, std::ios::binary);
        f << p->source;
    }
    std::vector<std::string> argv = {env_or("V4POOL_HIP_DOUBLE_CLANG", "clang-19"), "-x", "hip", "--offload-device-only",
                                     "--offload-arch=" + arch, "-nogpulib", "-nogpuinc", "-std=c++17",
                                     "--no-gpu-bundle-output"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    argv.insert(argv.end(), {"-o", out, src});
    const int rc = run_tool(argv, log);
    p->log = slurp(log);
    const std::string code = rc == 0 ? slurp(out) : std::string();
    p->code.assign(code.begin(), code.end());
    for (const auto& f : {src, out, log}) unlink(f.c_str());
    rmdir(dir.c_str());
    if (rc == -1) {
        p->log = "the double's hiprtc could not run " + argv[0] + "\n" + p->log;
        return HIPRTC_ERROR_INTERNAL_ERROR;
    }
    return rc == 0 && !p->code.empty() ? HIPRTC_SUCCESS : HIPRTC_ERROR_COMPILATION;
}

int hiprtcGetCodeSize(void* prog, size_t* size) {
    RtcProgram* p = program_of(prog);
    if (!p || !size) return HIPRTC_ERROR_INVALID_INPUT;
    *size = p->code.size();
    return HIPRTC_SUCCESS;
}

int hiprtcGetCode(void* prog, char* code) {
    RtcProgram* p = program_of(prog);
    if (!p || !code) return HIPRTC_ERROR_INVALID_INPUT;
    std::memcpy(code, p->code.data(), p->code.size());
    return HIPRTC_SUCCESS;
}

int hiprtcGetProgramLogSize(void* prog, size_t* size) {
    RtcProgram* p = program_of(prog);
    if (!p || !size) return HIPRTC_ERROR_INVALID_INPUT;
    *size = p->log.size() + 1;
    return HIPRTC_SUCCESS;
}

int hiprtcGetProgramLog(void* prog, char* log) {
    RtcProgram* p = program_of(prog);
    if (!p || !log) return HIPRTC_ERROR_INVALID_INPUT;
    std::memcpy(log, p->log.c_str(), p->log.size() + 1);
    return HIPRTC_SUCCESS;
}

int hiprtcDestroyProgram(void** prog) {
    if (!prog) return HIPRTC_ERROR_INVALID_INPUT;
    std::lock_guard<std::mutex> l(g_rtc_m);
    if (!g_rtc.erase(*prog)) return HIPRTC_ERROR_INVALID_PROGRAM;
    *prog = nullptr;
    return HIPRTC_SUCCESS;
}

}  // extern "C"
