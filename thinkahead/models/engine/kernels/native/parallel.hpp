// Chunked parallel loops for the native linears (int8_linear.cpp, kquant_linear.cpp).
//
// `run_chunks(task, threads)` calls task.fn(task.ctx, c) once for every chunk c in [0, task.chunks);
// chunks are claimed dynamically from one counter. They run on torch's own OpenMP team when torch's
// libgomp is loaded: GOMP_parallel is looked up in the already-loaded libgomp.so.1 (dlopen
// RTLD_NOLOAD; no link-time OpenMP, so never a second runtime). Sharing the team matters on a small
// machine: libgomp's workers spin for a while after every torch op, and a pool of our own would
// compete with them for the cores (measured: a 1.5B decode step 17% slower than fbgemm's). Without
// libgomp, a persistent pool of our own runs the chunks.
//
// Which chunk runs on which thread never changes a result: every chunk writes its own outputs.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <dlfcn.h>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace thinkahead_native {

struct Task {
    void (*fn)(const void* ctx, int64_t chunk);
    const void* ctx;
    int64_t chunks;
};

using GompParallel = void (*)(void (*)(void*), void*, unsigned, unsigned);

inline GompParallel gomp_parallel() {
    static const GompParallel fn = [] {
        void* handle = dlopen("libgomp.so.1", RTLD_LAZY | RTLD_NOLOAD);  // torch's, if loaded; never a new one
        return handle == nullptr ? nullptr : reinterpret_cast<GompParallel>(dlsym(handle, "GOMP_parallel"));
    }();
    return fn;
}

inline std::atomic<bool>& use_openmp() {  // false: always the pool (set_threading, for comparisons)
    static std::atomic<bool> flag{true};
    return flag;
}

struct OmpShared {
    const Task* task;
    std::atomic<int64_t> next{0};
};

inline void omp_body(void* data) {
    auto* shared = static_cast<OmpShared*>(data);
    for (;;) {
        const int64_t c = shared->next.fetch_add(1, std::memory_order_relaxed);
        if (c >= shared->task->chunks) return;
        shared->task->fn(shared->task->ctx, c);
    }
}

class Pool {
public:
    ~Pool() {
        {
            std::lock_guard<std::mutex> lock(mu_);
            stop_ = true;
            ++generation_;
        }
        cv_.notify_all();
        for (auto& t : workers_) t.join();
    }

    // Runs every chunk of `task`, on the calling thread and up to threads - 1 workers.
    void run(const Task& task, int threads) {
        std::unique_lock<std::mutex> busy(run_mu_, std::try_to_lock);
        if (threads <= 1 || task.chunks <= 1) {
            for (int64_t c = 0; c < task.chunks; ++c) task.fn(task.ctx, c);
            return;
        }
        if (use_openmp().load(std::memory_order_relaxed) && gomp_parallel() != nullptr) {
            OmpShared shared;
            shared.task = &task;
            gomp_parallel()(&omp_body, &shared, static_cast<unsigned>(std::min<int64_t>(threads, task.chunks)), 0);
            return;
        }
        if (!busy.owns_lock()) {  // a concurrent caller runs alone
            for (int64_t c = 0; c < task.chunks; ++c) task.fn(task.ctx, c);
            return;
        }
        grow(threads - 1);
        task_ = &task;
        next_.store(0, std::memory_order_relaxed);
        done_.store(0, std::memory_order_relaxed);
        wanted_.store(threads - 1, std::memory_order_relaxed);
        open_.store(true, std::memory_order_seq_cst);
        {
            std::lock_guard<std::mutex> lock(mu_);
            ++generation_;
        }
        generation_seen_.fetch_add(1, std::memory_order_release);
        cv_.notify_all();
        work();
        spin_until([&] { return done_.load(std::memory_order_acquire) >= task.chunks; });
        open_.store(false, std::memory_order_seq_cst);
        spin_until([&] { return inside_.load(std::memory_order_seq_cst) == 0; });
        task_ = nullptr;
    }

private:
    template <class Pred>
    static void spin_until(Pred done) {
        for (int i = 0; !done(); ++i) {
            if (i < 4096) _mm_pause();
            else std::this_thread::yield();
        }
    }

    void work() {
        const Task& task = *task_;
        for (;;) {
            const int64_t c = next_.fetch_add(1, std::memory_order_relaxed);
            if (c >= task.chunks) return;
            task.fn(task.ctx, c);
            done_.fetch_add(1, std::memory_order_release);
        }
    }

    void grow(int workers) {
        while (static_cast<int>(workers_.size()) < workers) {
            const int index = static_cast<int>(workers_.size());
            workers_.emplace_back([this, index] { loop(index); });
        }
    }

    void loop(int index) {
        uint64_t seen = generation_seen_.load(std::memory_order_acquire);
        for (;;) {
            // Spin a little (layers follow each other within microseconds), then sleep.
            const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(SPIN_US);
            for (int i = 0; generation_seen_.load(std::memory_order_acquire) == seen; ++i) {
                _mm_pause();
                if ((i & 255) == 255 && std::chrono::steady_clock::now() > until) break;
            }
            {
                std::unique_lock<std::mutex> lock(mu_);
                cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
                if (stop_) return;
                seen = generation_;
            }
            inside_.fetch_add(1, std::memory_order_seq_cst);
            if (open_.load(std::memory_order_seq_cst) && index < wanted_.load(std::memory_order_relaxed)) work();
            inside_.fetch_sub(1, std::memory_order_seq_cst);
        }
    }

    static constexpr int SPIN_US = 200;
    std::mutex run_mu_;
    std::mutex mu_;
    std::condition_variable cv_;
    uint64_t generation_ = 0;                    // guarded by mu_
    std::atomic<uint64_t> generation_seen_{0};   // the same count, readable without the lock
    bool stop_ = false;
    std::vector<std::thread> workers_;
    const Task* task_ = nullptr;
    std::atomic<bool> open_{false};
    std::atomic<int> inside_{0};
    std::atomic<int> wanted_{0};
    std::atomic<int64_t> next_{0};
    std::atomic<int64_t> done_{0};
};

inline void run_chunks(const Task& task, int threads) {
    static Pool* pool = new Pool();  // never destroyed: workers must not be joined at exit
    pool->run(task, threads);
}

inline std::string threading() {
    return use_openmp().load() && gomp_parallel() != nullptr ? "openmp" : "pool";
}

inline void set_threading(const std::string& mode) {
    if (mode != "openmp" && mode != "pool") throw std::invalid_argument("threading: openmp or pool");
    use_openmp().store(mode == "openmp");
}

inline bool avx2_fma_supported() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

template <class T>
T* as_ptr(uintptr_t address) {
    return reinterpret_cast<T*>(address);
}

}  // namespace thinkahead_native
