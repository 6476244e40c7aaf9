// A multi-stage shared-memory pipeline on mbarriers, filled by TMA or cp.async and drained by the consumer warps.
//
// Each stage has two barriers:
//   full[s]   TMA: arrive count 1: the producer's arrive.expect_tx announces the TMA bytes; the stage is full
//             once the copy engine has delivered them (complete_tx). cp.async gather: arrive count = the 128
//             producer threads, each arriving when its own copies have landed (cp.async.mbarrier.arrive.noinc);
//   empty[s]  arrive count = consumer warps: one elected lane of each consumer warp arrives once its
//             warpgroup's wgmma reads of the stage have completed (after warpgroup_wait).
// A barrier completes phases 0, 1, 0, ...; a waiter names the parity of the phase it waits for. The
// consumer starts waiting for phase 0 of full[0]; the producer starts at parity 1 on empty[], which
// counts as already completed, so its first pass over the stages does not block.
#pragma once

#include <cstdint>

#include <cutlass/arch/barrier.h>
#include <cute/arch/cluster_sm90.hpp>

namespace fpv2::hopper {

// Position in a ring of kStages stages: the stage index and the parity of the barrier phase to wait for.
template <int kStages>
struct PipelineState {
  int stage = 0;
  uint32_t phase = 0;

  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

template <int kStages>
struct KvPipelineStorage {
  alignas(8) uint64_t full[kStages];
  alignas(8) uint64_t empty[kStages];
};

template <int kStages>
class KvPipeline {
 public:
  using Storage = KvPipelineStorage<kStages>;
  using State = PipelineState<kStages>;

  __device__ explicit KvPipeline(Storage& storage) : storage_(storage) {}

  // One thread initialises; the caller fences (fence_barrier_init) and synchronises the CTA afterwards.
  __device__ static void init(Storage& storage, uint32_t producer_arrivals, uint32_t consumer_arrivals) {
    for (int s = 0; s < kStages; ++s) {
      cutlass::arch::ClusterTransactionBarrier::init(&storage.full[s], producer_arrivals);
      cutlass::arch::ClusterBarrier::init(&storage.empty[s], consumer_arrivals);
    }
  }

  __device__ static State producer_start() { return State{0, 1u}; }
  __device__ static State consumer_start() { return State{0, 0u}; }

  // Producer (one thread): wait until the consumers released the stage, then announce `bytes` of TMA
  // traffic on its full barrier. Returns the barrier the TMA copies complete on.
  __device__ uint64_t& producer_acquire(State const& state, uint32_t bytes) {
    cutlass::arch::ClusterBarrier::wait(&storage_.empty[state.stage], state.phase);
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&storage_.full[state.stage], bytes);
    return storage_.full[state.stage];
  }

  // Gather producer (every producer thread): wait until the consumers released the stage.
  __device__ void producer_wait_empty(State const& state) {
    cutlass::arch::ClusterBarrier::wait(&storage_.empty[state.stage], state.phase);
  }

  // Gather producer (every producer thread, after issuing its cp.async copies into the stage): one arrival
  // on the stage's full barrier once all of this thread's earlier cp.async copies have completed.
  __device__ void producer_commit_cp_async(State const& state) {
    cutlass::arch::cpasync_barrier_arrive_noinc(&storage_.full[state.stage]);
  }

  // Consumer (every thread of a consumer warp): wait until the stage's bytes have landed.
  __device__ void consumer_wait(State const& state) const {
    cutlass::arch::ClusterBarrier::wait(&storage_.full[state.stage], state.phase);
  }

  // Consumer: the warp's reads of the stage are complete (its wgmma were waited for); one lane arrives.
  __device__ void consumer_release(State const& state) {
    __syncwarp();
    if (cute::elect_one_sync()) {
      cutlass::arch::ClusterBarrier::arrive(&storage_.empty[state.stage]);
    }
  }

 private:
  Storage& storage_;
};

}  // namespace fpv2::hopper
