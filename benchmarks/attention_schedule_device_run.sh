#!/usr/bin/env bash
# Device run: the Hopper attention kernel's tile schedules re-timed on the planted pipeline with today's kernel
# (one CTA per tile, the default, against the opt-in persistent CTAs of FPV2_HOPPER_PERSISTENT), from the
# repository root, with the library built on the development machine. Written in the 32nd session.
#
#   benchmarks/attention_schedule_device_run.sh probe  attention_switch_probe.py with FPV2_HOPPER_PERSISTENT
#                                                      alternating 0 / 1 / dynamic in one process: 128K B = 1
#                                                      (correction off and mean) and 4 x 128K (mean), page 1
#   benchmarks/attention_schedule_device_run.sh rows   fpv2 bench --sparse-only rows at 128K, page 1, mean
#                                                      correction, FPV2_HOPPER_PERSISTENT=0 and =$SETTING
#                                                      [dynamic] alternating, A B B A, one process a row
#   benchmarks/attention_schedule_device_run.sh profile  ncu of the 128K corrected attention launch under
#                                                      FPV2_HOPPER_PERSISTENT=0 and =dynamic: first at locked base
#                                                      clocks (ncu's default; speed of light, warp states,
#                                                      scheduler, memory), then at free clocks (duration and mean
#                                                      SM clock only), each setting in its own process
#   benchmarks/attention_schedule_device_run.sh order  the work order (FPV2_HOPPER_WORK_ORDER=1: tiles by decreasing
#                                                      kept-block work, two small kernels before the launch) with
#                                                      persistent CTAs: attention_switch_probe.py at 128K (off,
#                                                      mean) three ways: PERSISTENT 0 / dynamic; the same with the
#                                                      order on; the order 0 / 1 under dynamic
#   benchmarks/attention_schedule_device_run.sh combined  the default against dynamic + order in one process
#                                                      (--env-sets): 128K (off, mean) and 4 x 128K (mean); then
#                                                      fpv2 bench --sparse-only rows at 128K, A B B A
#   benchmarks/attention_schedule_device_run.sh order-profile  the `profile` part's locked-clock ncu for the queue,
#                                                      the queue in the work order, and one CTA per tile
#   benchmarks/attention_schedule_device_run.sh sizes  where else the queue in the work order pays (shipped library,
#                                                      no patch needed): --env-sets default against queue + order
#                                                      at 8K, 32K, 64K (B = 1), 4 x 32K, and a 16K chunk after a
#                                                      112K cached prefix; mean correction (32K also off)
#   benchmarks/attention_schedule_device_run.sh threshold  the smallest calls the pair pays for and which half pays:
#                                                      --env-sets one CTA per tile, the order alone, the queue
#                                                      alone, both; chunks after cached prefixes (16K after 112K
#                                                      off and mean, 8K after 120K and 56K, 4K after 124K), 16K and
#                                                      8K without a prefix, 4 x 8K
#   benchmarks/attention_schedule_device_run.sh prefixes  `threshold`'s four settings where the rule's edges are:
#                                                      8K chunks after 8K and 24K, a 2K chunk after 126K, four 8K
#                                                      chunks after 56K, a 32K chunk after 96K, 24K and 32K fresh
#   benchmarks/attention_schedule_device_run.sh default-check  with BIN built from the tree (schedule_default.hpp): the
#                                                      kernel package's GPU suite, then --env-sets the default
#                                                      (both switches "") against the decoded order (both "0") on
#                                                      the planted and the drifting workloads, and the list-schedule
#                                                      model of the drifting calls (tile_schedule_model.py)
#   benchmarks/attention_schedule_device_run.sh sanitize-default  compute-sanitizer memcheck and racecheck of the
#                                                      default schedule's GPU tests of a chunk after a prefix (the
#                                                      work order with one CTA per tile, sparse and corrected)
#   benchmarks/attention_schedule_device_run.sh chunked  benchmarks/chunked_prefill.py (128K prompt in 8K chunks,
#                                                      Hopper backend, no error column) with the default schedule
#                                                      and with the decoded order (both switches 0), one process each
#   benchmarks/attention_schedule_device_run.sh engine-chunks  benchmarks/chunked_prefill.py --uncarried (128K in 8K
#                                                      chunks, mean correction, no error column) at page 1, 16
#                                                      and 128 on the Hopper backend and page 1 on Triton: the
#                                                      per-chunk pipeline (what the adapters ran) against the
#                                                      chunk-aware one without carried tile pages (what the SGLang
#                                                      adapter runs since the 36th session); CHUNKS (chunk sizes,
#                                                      one process a setting) [8192] and SETTINGS (backend:page
#                                                      pairs) [hopper:1 hopper:16 hopper:128 triton:1]
#   benchmarks/attention_schedule_device_run.sh no-tail  --env-sets the default against the decoded order with
#                                                      SelectionConfig.dense_tail_tiles=0 (no tile keeps its whole
#                                                      span: a chunk-aware pipeline's middle chunks)
#   benchmarks/attention_schedule_device_run.sh triton-order  the Triton kernel's work order (FPV2_TRITON_WORK_ORDER
#                                                      0 / 1 in one process, Triton backend): chunks after prefixes
#                                                      (16K after 112K, 8K after 56K, 4 x (8K after 56K)), fresh 8K,
#                                                      32K and 128K; mean correction; 16K after 112K also without the
#                                                      dense tail
#   benchmarks/attention_schedule_device_run.sh chunk-attention  chunk_attention_probe.py (128K in 8K chunks, Hopper
#                                                      backend, mean correction): each chunk's attention call of the
#                                                      per-chunk and the chunk-aware pipelines, its stage time in the
#                                                      eager run and its replayed launch; under the default and under
#                                                      the decoded order (both switches 0), one process each
#   benchmarks/attention_schedule_device_run.sh triton-even  the Triton kernel's automatic work order: --env-sets
#                                                      FPV2_TRITON_WORK_ORDER=0 against the rule (unset) with
#                                                      FPV2_TRITON_ORDER_LIGHT_BLOCKS 0 (every segment sorted, the
#                                                      default) and 64 (Triton backend, mean correction): chunks after
#                                                      prefixes with and without the dense tail, and fresh 8K (the
#                                                      rule leaves it decoded)
#   benchmarks/attention_schedule_device_run.sh triton-order-kernel  work_order_speed.py (the one-launch order
#                                                      against torch.argsort), then FPV2_TRITON_WORK_ORDER 0 against 1
#                                                      on triton-even's shapes (Triton backend, mean correction)
#   benchmarks/attention_schedule_device_run.sh triton-fresh-order  FPV2_TRITON_WORK_ORDER 0 against 1 on fresh
#                                                      calls (8K, 32K, 128K, 4 x 32K; Triton backend, mean correction)
#   benchmarks/attention_schedule_device_run.sh chunk-host  chunk_host_profile.py: cProfile of the chunk-aware and
#                                                      per-chunk pipelines (128K in 8K chunks, Hopper backend, page 1)
#   benchmarks/attention_schedule_device_run.sh suites  the kernel and serving packages' GPU suites (the serving
#                                                      soak left out)
#   benchmarks/attention_schedule_device_run.sh chunk-profile  the locked-clock ncu of `order-profile` for the 16K
#                                                      chunk after a 112K prefix: one CTA per tile and the pair
#   benchmarks/attention_schedule_device_run.sh land-default  with BIN built from the tree (ran with the 32nd
#                                                      session's default-tile-queue.patch): the queue / order GPU tests
#                                                      (the patch's two new ones among them), the kernel package's
#                                                      GPU suite, then --sparse-only rows at 128K, the new default
#                                                      against FPV2_HOPPER_PERSISTENT=0, A B B A
#
# Why (NOTES.md, tenth session): with only the forced blocks a tile (keep 0) the dynamic queue was 21% faster
# than one CTA per tile at 128K, about 1.6 us a tile, the prologue and epilogue that a persistent CTA hides. At the
# planted workload's ~24 steps a tile (~40 us) that is ~4% of the kernel, yet the planted pipeline was a tie then
# (13.600 against 13.646 ms). The kernel has changed much since (overlapped consumers everywhere, the correction's
# table built by the producer's idle warps for one CTA per tile, scoring and copies moved), and no schedule has been
# timed on it since.
#
# Predictions (written before the run):
# - probe, 128K mean: dynamic -3% to +2% against one CTA per tile, snake (1) +0 to +5%; correction off the same
#   within 2 points; 4 x 128K as 128K. The outputs equal (max difference 0: the same blocks in the same order per
#   tile). If dynamic wins by >= 2% at both sizes it is worth making the default for large calls (rows decide).
# - rows: as the probe's difference, within the rows' spread (~1%).
#
# Measured (32nd session, H100; results/2026-12-06-h100-attention-schedule/): dynamic -2.3% at 128K mean, +1.0% off,
# -0.7% at 4 x 128K; rows -1.1% (inside their spread). Snake +2.6 to +11.9%. The default stays one CTA per tile.
#
# Predictions for `profile` (written before it ran, after the probe and rows above): at locked clocks dynamic
# is 3-5% faster than one CTA per tile (its hidden prologue, ~1.6 us a tile at keep 0); at free clocks its mean SM
# clock is 1-3% lower (the board is at its power cap, and busier tensor cores draw more), which leaves the 1-2%
# measured. If the locked-clock difference is also about 1%, power is not the story and the persistent consumers
# lose the rest in their steps.
#
# Predictions for `order` (written before it ran, after `profile` on an H200): under the queue the SMs were active
# 2.4% fewer cycles than with one CTA per tile but for 95.3% of the elapsed cycles against 97.1%. If that idle time
# is the tail (the last tiles of head-major order are heavy-to-light within each KV head, but a late heavy tile can
# still run alone), the order (globally heaviest first) recovers 1-1.5 points under the queue: dynamic + order -2 to
# -3.5% against one CTA per tile, and the order alone under the queue -1 to -1.5%. With one CTA per tile the order
# changes little at B = 1 (+-1%; the tenth session measured it slower on uneven batches). If the idle time is at the
# start (the first tile of every CTA has no hidden prologue), the order changes nothing.
#
# Measured (`order`, an H100): under the queue the order took -8.0% (off) and -3.7% (mean) in one process; the queue
# against one CTA per tile, both without the order, +2.5% / +1.0% on that machine (-2.3% mean on the first H100).
# Predictions for `combined` (written before it ran, from those in-process ratios): dynamic + order against the
# default -4 to -7% uncorrected and -2 to -4% corrected at 128K, -2 to -4% at 4 x 128K; the rows -1.5 to -3%. Outputs
# identical.
#
# Measured (`combined`, an H100): -7.0% / -5.5% at 128K (off / mean), -1.6% at 4 x 128K; rows -3.6%; outputs equal.
# Predictions for `land-default` (written in the 32nd session, before it ran): every test passes (the new ones:
# the default's workspace equals the explicit queue + order's, its output equals one CTA per tile's bit for bit,
# the calls the rule leaves out ask for no workspace); the rows move as `combined`'s: the default 2.5-4.5% below
# FPV2_HOPPER_PERSISTENT=0, the same error.
#
# Predictions for `order-profile` (32nd session, before any run): if the order's 4-8% under the queue is balance,
# the queue's SM-active share of the elapsed cycles (95.3% on the H200) rises to one CTA per tile's 97% or more at
# about the same active cycles; if it is locality, the L2 hit rate rises or the DRAM bytes fall, and the active
# cycles drop.
#
# Predictions for `sizes` (32nd session, before any run): the gain shrinks with the tiles a call has, since the
# order has fewer heavy tiles to put first and the queue fewer prologues to hide: 64K -3 to -5%, 32K and 4 x 32K
# -1 to -4%, 8K (2,048 tiles, ~15 waves) -2 to +2%; the chunk after a prefix (4,096 heavy tiles, uneven work) -2
# to -6%. If 32K and the chunk gain >= 2%, the default's threshold should come down to them.
#
# Measured (`sizes`, 33rd session, an H100, library of default-tile-queue.patch): 8K +1.4%, 32K -10.0% off and
# -7.5% mean, 64K -4.3%, 4 x 32K -0.8%, the 16K chunk after a 112K prefix -36.5% (3.168 -> 2.010 ms); outputs
# equal. 32K and the chunk gain >= 2%, so the threshold comes down; `threshold` finds where.
#
# Predictions for `threshold` (33rd session, before it ran): the chunk's -36% replicates within 5 points, and
# correction off the same within 5 points (so it is not the correction's table). One CTA per tile gives every tile
# of a chunk the same ~1,000-block row span and the tiles of one KV head run together; most of the gain is the
# queue's (the order alone -0 to -10%). 8K and 4K chunks after long prefixes -15 to -35% (2,048 and 1,024 tiles,
# still many waves of heavy tiles), the 8K chunk after 56K about half that. 16K without a prefix (4,096 tiles)
# -2 to -6%, 8K -2 to +2% again, 4 x 8K -0 to -4%. If so the rule wants the work of a call, not its tiles: the
# query tiles times the mean key span, known on the host from the batch's lengths.
#
# Predictions for `chunk-profile`: one CTA per tile's SM-active share of the elapsed cycles is below 85% (idle
# SMs: the grid's last waves or a serialising resource), or its L2 hit rate is >= 10 points lower at the same
# active share (the tiles resident together read different keys).
#
# Measured (`threshold`, 33rd session, an H100): the chunks' gain is the order's, not the queue's. One CTA per tile
# in the work order: 16K after 112K -38.8% off / -34.2% mean, 8K after 120K -33.3%, 8K after 56K -35.7%, 4K after
# 124K -18.6%; the queue alone +5.7 to +24.2%; the pair -6.2 to -35.1%. Fresh calls of 4,096 tiles or fewer: every
# setting +0.9 to +9.5% (16K, 8K, 4 x 8K). `chunk-profile` (16K after 112K, locked clocks): one CTA per tile keeps
# the SMs active 60.6% of the elapsed cycles (3.34 M of 5.51 M), the pair 98.1% (3.31 M of 3.37 M), at the same
# active cycles and L2 hit rate (87.6 / 85.9%): the decoded order leaves SMs idle, the work is the same. A tail of
# a few heavy tiles started late fits that (a tile keeping most of a 112K prefix is ~1 ms, a third of the call).
#
# Predictions for `prefixes` (33rd session, before it ran): the order alone wins wherever the call has a cached
# prefix and many waves: 8K after 24K -10 to -30%, after 8K -0 to -20% (a heavy tile is shorter against the
# call), 4 x (8K after 56K) -10 to -30% (the auto rule's case), 32K after 96K -10 to -25%, the 2K chunk (512 tiles,
# ~4 waves) -0 to -20%. Fresh 24K and 32K: the pair -3 to -8%, the order alone within 2 points of the pair.
#
# Measured (`prefixes`, an H100): the order alone 8K after 8K / 24K -20.5 / -31.9%, 2K after 126K -10.2%, 4 x (8K
# after 56K) -15.7%, 32K after 96K -20.0%, fresh 24K / 32K -3.7 / -6.2%; the pair -20.1, -32.1, +3.6, -17.7, -21.6,
# -3.6, -7.8%; the queue alone +2.1 to +10.8%. tile_schedule_model.py (index of the same workloads): every planted
# call keeps all visible blocks of some tile (kept_max = the causal span), and the work order's makespan over the
# decoded order's ranks the calls as the probes do (0.58-0.92 for the chunks, 0.87-0.98 for fresh calls), with the
# fresh calls' gains overstated by the order's cost (~2%). schedule_default.hpp turns that into the default.
#
# Predictions for `default-check` (33rd session, before it ran): every test passes. Planted: the default matches
# the best setting measured for each shape, 16K after 112K about -34%, 2K after 126K -10%, 4 x (8K after 56K) -16%,
# 32K -8%, 128K -5.5%, fresh 8K within 1% (the same schedule). Drifting background: if its index has no tile that
# keeps its whole span, the chunks' gain falls to -5 to +5% (the 2026-12-02 kernel measured the order +3 to +9% on
# a uniform random index); the model's heaviest-tile share says which.
#
# Measured (`default-check`, an H100): the kernel suite 357 passed, 2 skipped. The default against the decoded
# order (both switches 0), planted: 16K after 112K -35.3%, 2K after 126K -10.7%, 4 x (8K after 56K) -16.7%, fresh
# 8K 0.0%, 32K -8.7%, 128K -6.0%; drifting background (256): 16K after 112K -41.8%, 8K after 56K -32.9%, 32K
# -12.9%. The drifting index also keeps whole spans (kept_max = the span); outputs equal.
# Prediction for `sanitize-default`: memcheck 0 errors, racecheck 0 hazards, the tests pass under both.
#
# Measured (`sanitize-default`, an H100): memcheck 0 errors, racecheck 0 hazards, 2 passed under each.
# Prediction for `chunked` (before it ran): the chunk-aware pipeline's attention over the sixteen 8K chunks of a
# 128K prompt falls 20-30% under the default (most chunks have long prefixes: -20 to -36% above), its whole time
# 15-25%; the unchunked row -5 to -6% (128K); the dense rows unchanged (dense mode keeps the decoded order).
#
# Measured (`chunked`, an H100, eager medians of 5): under the default the naive per-chunk pipeline (a dense tail
# tile in every chunk) 27.31 -> 20.29 ms (attention 21.71 -> 14.68, -32%), but the chunk-aware pipeline (one dense
# tail tile, in the last chunk) 21.69 -> 21.68 (attention 17.15 -> 16.81, -2%). So the heavy tiles of the probes
# are the index's dense tail tiles (SelectionConfig.dense_tail_tiles, the last query tile of a request keeps its
# whole span), not diffuse rows.
# Prediction for `no-tail` (before it ran): without the dense tail the order has no heavy tile to place: chunks
# after prefixes 0 to +4% (the order's kernels and lost L2 neighbours), fresh 32K and 128K -0 to -4% (the queue).
#
# Measured (`no-tail`, an H100): the default against the decoded order without the dense tail: chunks +0.6 to
# +2.0%, fresh 32K -0.1%, fresh 128K -4.1%.
# Prediction for `triton-order` (33rd session, before it ran; the Triton kernel's order, opt-in): chunks after a
# prefix with their dense tail -10 to -35% (as the Hopper kernel's order alone: the same tail, less where the Triton
# kernel runs more than one program per SM); fresh 8K -2 to +3%,
# 32K and 128K -0 to -6% (the Hopper order alone: 32K -6.2%); without the dense tail 0 to +3%. If the chunks gain
# >= 10% and fresh calls lose < 2%, the order becomes the Triton kernel's default for calls with a cached prefix.
# Prediction for `chunk-attention` (34th session, before it ran): under the default the chunk-aware pipeline's
# attention stage summed 16.81 ms against the per-chunk pipeline's 14.68 at a lower density (0.0379 / 0.0414), and
# the unchunked call at the same density as the chunk-aware one took 12.2. Its chunks see the same kept blocks per
# tile as the unchunked call, so the kernels alone (replays) should sum to about the unchunked call's 11.5-12.5 ms
# plus sixteen launch tails (~0.05 ms each): aware replay sum 12-13.5 ms, below the per-chunk pipeline's (13.5-14.5,
# its dense tails). Then the rest of the 16.81 is the eager run's host time inside the stage (the GPU idle while
# the host prepares the launch), not the kernel. If instead the aware replays sum >= 15 ms, some of its chunks'
# launches are slow per kept block (the per-chunk rows say which).
#
# Measured (`chunk-attention`, 34th session, an H100): the prediction was wrong. Under the default the aware replays
# sum to 16.16 ms (per-chunk pipeline 15.25): the kernels, not host gaps (stage sums 16.86 / 15.14). Per chunk the
# aware launch is slower at fewer kept blocks (40K prefix: 23,404 kept 0.665 ms against 25,866 kept 0.560). Cause:
# at page size 1 the Hopper backend copies each call's whole KV into tile pages (tile_repack_policy), inside the
# aware pipeline's attention call, while the per-chunk pipeline's copy is made by its pooling kernel (index stage):
# about 8.5 copies of the 128K prompt. Fixed by carrying the tile pages across chunks (chunked_tile_pages.py).
# Prediction for `chunk-attention` and `chunked` with the carried pages (before they ran): the aware replays lose
# the per-call copies, ~0.4 ms of H100 time per 128K of KV, 8.5 prompts' worth: 16.2 -> 12.5-13.5 ms, below the
# per-chunk pipeline's 15.2 (its dense tails); its index stage gains the carried copies (~16 x 0.03 ms). The
# chunk-aware whole prefill (`chunked`, default schedule) 21.7 -> 18.5-19.5 ms; per-chunk and unchunked rows unchanged.
# `even-order` (34th session, removed with its experiments/even-order.patch): the Hopper scatter kernel kept the
# decoded order when no tile's work reached 8 or 16 times the mean. Predicted -0.5 to -2% on chunks without the
# dense tail, measured within +-1% of ratio 0 on all six shapes (H100, results/2026-12-06-h100-chunk-tile-pages/):
# rejected.
# Measured (`triton-order`, 34th session, an H100): with the dense tail 16K after 112K -30.8%, 8K after 56K -28.1%,
# 4 x (8K after 56K) -15.8%; fresh 8K +9.6%, 32K -5.7%, 128K -0.6%; 16K after 112K without the tail +6.3%. The
# chunks gain >= 10%, so the order is now the Triton default for calls with a cached prefix (work_order.py).
# First `triton-even` (an even-call check by FPV2_TRITON_ORDER_EVEN_RATIO, predicted to leave chunks without the
# tail decoded): the rule's full sort -31.6 / -6.9% with the tail, +4.8 / +14.1% without; ratios 8 and 16 never
# kept the decoded order and cost ~0.15 ms of small kernels more (+8.7 / +22.7%): removed. Replaced by the light
# bound: segments keeping fewer than 64 blocks keep the decoded order after the heavy ones (no extra kernel). Not
# run (the session's device time ran out); the default stays the measured full sort until it is.
# Prediction for `triton-even` with the light bound (before it ran): with the tail within 2% of the full sort
# (the dense-tail segments still first); without it between the decoded order and the full sort (the same
# order as decoded, plus the order's own small kernels, part of the full sort's +4.8 / +14.1%); fresh 8K equal in
# all three. If so, 64 becomes DEFAULT_LIGHT_BLOCKS.
#
# Prediction for `chunked` with SETTINGS="unfused default" (35th session, before it ran): the chunk's pooling launch
# now fills the carried tile pages (`FPV2_CHUNKED_FUSED_TILE_COPY`, default 1; `unfused` = 0, the 34th session's
# separate copy). Per chunk it saves a launch of ~25 us of GPU time and its host work (a touched batch, a
# non-blocking copy of its lengths, the launch), and the pooling kernel writes the chunk's tokens once more
# (+5-10 us). Chunk-aware whole prefill (128K in 8K chunks, eager wall): -0.5 to -2 ms of ~20.7 (-2 to -10%); the
# naive and unchunked rows unchanged (no carried pages there). `chunk-attention` replays unchanged (the attention
# reads the same pages).
# Measured (`chunked`, SETTINGS="unfused default", one process each, an H100): chunk-aware 25.06 ms unfused
# (index 9.30) against 21.51 fused (index 6.60); the unchunked row moved 13.60 -> 14.35 between the two processes,
# and the 34th session's unfused row read 20.66. Too noisy to credit: rerun A B A B.
#
# `triton-even` measured (35th session, an H100): the light bound 64 against the full sort: with the tail -29.9 /
# -8.3% against -29.0 / -8.0%, without it +7.0 / +16.0% against +7.6 / +15.7%, fresh 8K -0.8 / -0.3%. Light
# segments in the decoded order cost as much as sorted ones: the cost without a tail is building and reading the
# order (about 0.2-0.3 ms), not the order. Light bound rejected and removed.
#
# Prediction for `triton-order-kernel` (before it ran): the order by one Triton launch (a counting sort over the 32
# buckets) instead of frexp/where/argsort on 64-bit keys (a radix sort of several launches). work_order_speed: the
# kernel <= 0.03 ms eager at 2-4K segments, the argsort 0.1-0.3 ms; equal orders. Probe, order 1 against 0: the
# chunks without a tail +7.6 / +15.7% -> 0 to +4%; with it -29.0 / -8.0% -> -31 to -34% / -10 to -13%; fresh 8K
# (order forced on here) +0 to +4% (the argsort order: +9.6%).
#
# Measured (`triton-order-kernel`, 35th session, an H100; results/2026-12-06-h100-fused-tile-copy/): kernel 0.059 /
# 0.098 ms eager at 2K / 4K segments against the argsort's 0.249 / 0.255, but 0.341 / 0.674 at 16K / 32K against
# 0.297 / 0.334 (so the argsort above 8,192 segments); order 1 against 0: with the tail -33.0% / -12.8%, without it
# +2.4% / +5.3%, fresh 8K forced -2.3%.
#
# Then the order became two launches (per 256 segments their bucket counts, then each segment's place), replacing
# both the one-program kernel and the argsort fallback. Prediction for `triton-order-kernel` again (before it ran):
# work_order_speed <= 0.05 ms eager at every size (2K-32K segments), equal orders; the probe as the one-program
# kernel's within 1 point (its calls have 512-4,096 segments).
#
# Prediction for `triton-fresh-order` (before it ran, with the two launches): the order forced on fresh calls (the
# rule leaves them decoded): 8K -2 to -3% (as above), 32K -6 to -9% (the argsort's -5.7% plus ~0.2 ms less to
# build), 128K -1 to -3% (the argsort's -0.6% plus ~0.3 ms), 4 x 32K 0 to -4%. If none is worse, the rule orders
# every call with more segments than SMs.
#
# Measured (35th session, an H100; results/2026-12-06-h100-fused-tile-copy/): `chunked` A B A B unfused 21.01 /
# 20.20 ms, fused 18.69 / 18.64 (-8 to -11%, all in the index stage). `triton-order-kernel` with the two launches:
# 0.042-0.053 ms eager at 2-32K segments (argsort 0.21-0.25); 16K after 112K -33.9%, 2K after 126K -12.2%, no tail
# +1.8 / +3.9%, fresh 8K -3.0%. `triton-fresh-order`: 8K -3.5%, 32K -11.0%, 128K -1.5%, 4 x 32K -1.5%: the rule now
# orders every call with more segments than SMs.
#
# Prediction for `engine-chunks` (36th session, before it ran; wall of the whole 128K prefill in 8K chunks):
# sparse-aware-uncarried against sparse-naive at page 1 / Hopper within +-5% (its chunks pool only their own
# blocks and have no dense tail but pay the per-call tile copy in a launch of its own, where the naive pooling
# launch makes it; density 0.038 against 0.041); at page 128 (no copy) 5-15% faster and equal to sparse-aware;
# page 16 as page 1; Triton page 1 10-20% faster (no tile copy on Triton; the naive chunks' dense tails and prefix
# re-pooling go).
# Measured (36th session, an H100, first call of the machine, medians of 5): page 1 naive 23.60 ms, aware 31.21,
# uncarried 40.99; page 16 25.90 / 23.05 / 25.03; page 128 27.83 / 41.39 / 40.88; Triton page 1 45.53 / 35.20 /
# 33.06 (-27%, beyond the prediction). The Hopper aware rows are far off the 35th session's 18.6-18.7 ms for the
# same aware call at page 1, all of it in the index stage (13.8 against 4.8 ms; 22.3 at page 128), with spread
# between samples: not explained by the code (the uncarried rows make no tile pages).
# Prediction for `engine-chunks` with --host-ahead (added after the runs above; not run yet): with the host ahead (as
# in a model's forward, where each layer's GEMMs keep the GPU busier than the attention's host work) the chunks'
# kernels run back to back, and the chunk-aware rows without carried pages take less GPU time than the per-call rows
# on every backend: Hopper page 1 and 16 -5 to -15% (no dense tail per chunk, density 0.038 against 0.041, pooling only
# the chunk's blocks; both copy the prefix into tile pages per call), page 128 -10 to -20% (no copy), Triton -25 to
# -30% (as eager). The eager columns repeat the rows above within the host's spread. If the host-ahead rows agree, the
# Hopper kernel's per-call default in `chunk_aware_default` rests on a microbenchmark's host-boundness alone.
# Measured (37th session, one H100, two runs; results/2026-12-06-h100-engine-chunks-host-ahead/): host-ahead per call
# against chunk-aware uncarried, Hopper page 1 19.75 / 19.72 -> 18.06 / 18.08 ms (-8.4%), page 16 19.07 / 19.17 ->
# 17.15 / 17.19 (-10.2%), page 128 17.59 / 17.65 -> 14.21 / 14.25 (-19.2%), Triton 33.61 / 33.74 -> 26.80 / 26.69
# (-20.6%, less than predicted); eager on this host -3.3 / -6.0 / -11.1 / -18.5%. The SGLang adapter's default is
# now chunk-aware on every backend (fpv2-serving 0.1.14).
# Prediction for `engine-chunks` with CHUNKS="4096 16384" SETTINGS="hopper:1 hopper:128" (38th session, before it
# ran; host-ahead GPU time of the 128K prefill, against the 8K rows above: page 1 per call 19.75, uncarried 18.06;
# page 128 17.59 / 14.21): the uncarried chunk copies its whole KV into tile pages once a chunk, about L^2 / (2 C)
# tokens in all (about 3 ms at 8K), so at page 1 it moves by about -1.5 ms at 16K (16.3-17.0) and +3 ms at 4K
# (20.5-22.0); the per-call rows also copy per chunk and add a dense tail and the prefix's pooling per chunk:
# 16K 17.0-18.5, 4K 23-27, so the chunk-aware gain widens at 4K (-12 to -20%) and narrows at 16K (-3 to -8%). Page 128
# (no copy): uncarried 13.6-14.4 at 16K and 14.4-15.8 at 4K (more launches, smaller grids); per call 16.0-17.0 at 16K
# and 20-23 at 4K.
# Measured (38th session, one H100; results/2026-12-06-h100-chunk-size-sweep/): the direction held (the gain grows as
# chunks shrink), the sizes missed: page 1 uncarried 15.09 / 15.12 at 16K and 23.66 / 23.72 at 4K, per call 14.96 /
# 14.98 and 34.70 / 34.87 (4K: 159 dense tiles and 16,896 pooled blocks per call), so -31.9% at 4K and +0.9% at 16K;
# page 16 +0.6% at 16K, -34.2% at 4K; page 128 uncarried 13.01 / 12.95 and 16.67 / 16.66, per call 13.87 / 13.77 and
# 31.04 / 31.12 (-6.1%, -46.4%); Triton 16K -4.9% (4K: eager -37.1%; never got ahead).
# The 8K control repeated the 37th session's rows within 1.6%.
# Prediction for `chunk-host` with PAGES="1 128" MODES="aware uncarried naive" (before it ran): if this is the
# host (a slower or busier CPU), the plain walls repeat the rows above and the profiles show the same functions as
# the 35th session's, each slower; if it was that call, aware page 1 returns to about 18.7 ms.
# Measured: aware page 1 29.92 ms plain (46.36 profiled), uncarried 33.33, naive 24.74; page 128 27.83 / 28.02 /
# 21.98. The profiles hold the 35th session's functions, each ~1.6x slower: a slower host, and host-bound calls.
# Prediction for `chunk-host` with TREES=". .carry/base-src . .carry/base-src" PAGES="1 128" MODES="uncarried naive"
# (36th session's host trims against c9ee1e3, before it ran): the chunk-aware chunk's host work falls by 0.2-0.3 ms
# (the dense-tile counts in integers instead of CPU tensors, the chunk's selection config cached, the index's second
# input check skipped, the statistics offsets in the pooling's host-to-device copy): uncarried -3 to -5 ms at both
# pages on a host like the last one; naive unchanged within 3% (the control).
# Measured (a faster host than the last one; results/2026-12-06-h100-engine-chunks/host-trims-ab*): page 1 uncarried
# 19.95 / 19.77 ms with the trims against 21.44 / 22.83 before (-7 to -13%), naive 20.42-20.47 in all four (the
# control held); page 128 uncarried 15.91 against 24.26 (one pair). Same host, trims only (`pages-ab/`, A B A B):
# page 16 uncarried 19.65 / 19.64 against naive 20.17 / 20.23, page 128 15.92 / 16.00 against 18.16 / 18.39.
#
# Environment: BIN folder with the shipped libfpv2_kernel.so [.carry/head]; SETTING [dynamic]; SETTINGS of `chunked`
# and `chunk-attention` [default decoded; also unfused]; PAGES [1], MODES [aware naive; also uncarried] and TREES
# [.; folders holding another packages/ tree, each run in turn] of `chunk-host`; OUT.
set -u -o pipefail
# shellcheck source=benchmarks/device_run_common.sh
source "$(dirname "${BASH_SOURCE[0]}")/device_run_common.sh"
device_run_start attention-schedule "${1:-probe}" "${BIN:-.carry/head}"
RESULTS="$LOGS/results"  # inside the part's archive: the device returns files at most two folders down
mkdir -p "$RESULTS"

# attention_switch_probe.py's JSON lines, each setting's median against the first setting's:
# settings_table FILE
settings_table() {
  python3 -c '
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    first, base = next(iter(r["median_ms"].items()))
    print(r["label"], r["mode"], {s: f"{m:.3f} ({100 * (m / base - 1):+.1f}%)" for s, m in r["median_ms"].items()},
          "min", list(r["min_ms"].values()), "max diff", list(r[f"max_abs_difference_vs_{first}"].values()))' "$1"
}

# attention_switch_probe.py with FPV2_TRITON_WORK_ORDER 0 against 1 (Triton backend, mean correction) for each
# "seqlen batch prefix dense-tail-tiles" shape, into NAME.jsonl, then the settings table:
# triton_order_probes NAME TIMEOUT SHAPE...
triton_order_probes() {
  local name=$1 limit=$2 shape seqlen batch prefix tail
  shift 2
  for shape in "$@"; do
    read -r seqlen batch prefix tail <<< "$shape"
    with_packages timeout "$limit" python3 benchmarks/attention_switch_probe.py --switch FPV2_TRITON_WORK_ORDER \
      --settings 0,1 --backend triton --seqlen "$seqlen" --batch "$batch" --prefix "$prefix" --modes mean \
      --rounds 6 --calls 3 --dense-tail-tiles "$tail" --label "L$seqlen-B$batch-P$prefix-T$tail" \
      >> "$RESULTS/$name.jsonl" 2> "$LOGS/$name-$seqlen-$batch-$prefix-$tail.log"
    echo "probe L=$seqlen B=$batch prefix=$prefix tail=$tail: rc=$?"
  done
  settings_table "$RESULTS/$name.jsonl"
}

# fpv2 bench --sparse-only rows at 128K (page 1, Hopper backend, mean correction), one process a row, A B B A,
# then their table; each setting is a label and the environment assignments of its rows ("" for none):
# ab_rows_128k LABEL_A ENV_A LABEL_B ENV_B
ab_rows_128k() {
  local run=0 pick label assignments
  for pick in a b b a; do
    run=$((run + 1))
    if [ "$pick" = a ]; then label="$1" assignments="$2"; else label="$3" assignments="$4"; fi
    (
      # shellcheck disable=SC2086  # the assignments are words
      [ -n "$assignments" ] && export $assignments
      bench_row 1 131072 "bench-128k-$run-$label" 120 --page-size 1 --backend hopper --sparse-only
    )
  done
  sparse_rows_table
}

if [ "$PART" = probe ]; then
  for shape in "1 off,mean" "4 mean"; do
    read -r batch modes <<< "$shape"
    with_packages timeout 200 python3 benchmarks/attention_switch_probe.py --switch FPV2_HOPPER_PERSISTENT \
      --settings 0,1,dynamic --seqlen 131072 --batch "$batch" --modes "$modes" --rounds 8 --calls 3 \
      --label "B$batch" >> "$RESULTS/persistent-probe.jsonl" 2> "$LOGS/probe-b$batch.log"
    echo "probe B=$batch: rc=$?"
  done
  settings_table "$RESULTS/persistent-probe.jsonl"
fi

if [ "$PART" = rows ]; then
  setting="${SETTING:-dynamic}"
  ab_rows_128k persistent-0 FPV2_HOPPER_PERSISTENT=0 "persistent-$setting" "FPV2_HOPPER_PERSISTENT=$setting"
fi

# ncu of the 128K corrected attention launch under one --env-sets setting, at locked base clocks, into
# $RESULTS/ncu-locked-NAME.txt, its key lines printed; further probe options (another shape) win over these:
# ncu_locked NAME SETTING [PROBE_OPTION...]
ncu_locked() {
  with_packages timeout 200 ncu --kernel-name regex:prefill_kernel \
    --launch-skip 1 --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
    --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
    --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg,sm__cycles_active.avg,lts__t_sector_hit_rate.pct,dram__bytes_read.sum,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed,sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_elapsed \
    python3 benchmarks/attention_switch_probe.py --env-sets "$2" \
    --seqlen 131072 --modes mean --rounds 1 --calls 1 --label "ncu-$1" "${@:3}" > "$RESULTS/ncu-locked-$1.txt" 2>&1
  echo "ncu locked $1: rc=$?"
  grep -E "gpu__time_duration|sm__cycles_elapsed.avg |sm__cycles_active|sector_hit_rate|dram__bytes_read|pipe_tensor_cycles|pipe_shared_cycles|issue_active|Grid Size|Issue Slots Busy|No Eligible|Active Warps Per Scheduler" \
    "$RESULTS/ncu-locked-$1.txt" | cut -c1-120
}

if [ "$PART" = profile ]; then
  for setting in 0 dynamic; do
    ncu_locked "$setting" "FPV2_HOPPER_PERSISTENT=$setting"
  done
  for setting in 0 dynamic 0 dynamic; do
    with_packages timeout 120 ncu --clock-control none \
      --kernel-name regex:prefill_kernel --launch-skip 1 --launch-count 3 \
      --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg,sm__cycles_elapsed.avg.per_second \
      python3 benchmarks/attention_switch_probe.py --env-sets "FPV2_HOPPER_PERSISTENT=$setting" \
      --seqlen 131072 --modes mean --rounds 1 --calls 3 --label "ncu-free-$setting" \
      >> "$RESULTS/ncu-free-$setting.txt" 2>&1
    echo "ncu free $setting: rc=$?"
  done
  grep -HE "gpu__time_duration|sm__cycles_elapsed.avg.per_second" "$RESULTS"/ncu-free-*.txt | sed 's#.*/##' | cut -c1-120
fi

if [ "$PART" = order-profile ]; then
  ncu_locked queue "FPV2_HOPPER_PERSISTENT=dynamic"
  ncu_locked queue-order "FPV2_HOPPER_PERSISTENT=dynamic:FPV2_HOPPER_WORK_ORDER=1"
  ncu_locked one-per-tile "FPV2_HOPPER_PERSISTENT=0"
fi

if [ "$PART" = default-check ]; then
  gpu_tests kernel-suite 330 packages/fpv2-kernel/tests -m "gpu or hopper"
  sets=("FPV2_HOPPER_PERSISTENT=:FPV2_HOPPER_WORK_ORDER=" "FPV2_HOPPER_PERSISTENT=0:FPV2_HOPPER_WORK_ORDER=0")
  for shape in "16384 1 114688 -" "2048 1 129024 -" "8192 4 57344 -" "8192 1 0 -" "32768 1 0 -" "131072 1 0 -" \
    "16384 1 114688 256" "8192 1 57344 256" "32768 1 0 256"; do
    read -r seqlen batch prefix drift <<< "$shape"
    extra=()
    [ "$drift" != - ] && extra=(--drift-tokens "$drift")
    with_packages timeout 150 python3 benchmarks/attention_switch_probe.py --env-sets "${sets[@]}" \
      --seqlen "$seqlen" --batch "$batch" --prefix "$prefix" --modes mean --rounds 10 --calls 5 "${extra[@]}" \
      --label "L$seqlen-B$batch-P$prefix-D$drift" >> "$RESULTS/default-check.jsonl" \
      2> "$LOGS/default-check-$seqlen-$batch-$prefix-$drift.log"
    echo "probe L=$seqlen B=$batch prefix=$prefix drift=$drift: rc=$?"
  done
  settings_table "$RESULTS/default-check.jsonl"
  (cd benchmarks && with_packages timeout 120 python3 tile_schedule_model.py --drift-tokens 256 \
    --shapes 16384:1:114688 8192:1:57344 32768:1:0 > "$RESULTS/tile-schedule-model-drifting.jsonl" \
    2> "$LOGS/tile-schedule-model-drifting.log")
  echo "model (drifting): rc=$?"
  cut -c1-330 "$RESULTS/tile-schedule-model-drifting.jsonl"
fi

if [ "$PART" = sanitize-default ]; then
  for tool in memcheck racecheck; do
    with_packages timeout 240 compute-sanitizer --tool "$tool" python3 -m pytest -p no:cacheprovider -q \
      packages/fpv2-kernel/tests/test_hopper_kernel.py -k chunks_after_a_prefix > "$RESULTS/sanitizer-$tool.txt" 2>&1
    echo "compute-sanitizer $tool: rc=$? $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" \
      "$RESULTS/sanitizer-$tool.txt" | tr '\n' ' ')"
  done
fi

if [ "$PART" = chunked ]; then
  run=0
  for setting in ${SETTINGS:-default decoded}; do  # a setting named twice runs twice (A B A B), numbered
    run=$((run + 1))
    (
      [ "$setting" = decoded ] && export FPV2_HOPPER_PERSISTENT=0 FPV2_HOPPER_WORK_ORDER=0
      [ "$setting" = unfused ] && export FPV2_CHUNKED_FUSED_TILE_COPY=0
      with_packages timeout 200 python3 benchmarks/chunked_prefill.py --chunks 8192 --backend hopper --no-error \
        --repeats 5 --warmup 2 ${CHUNKED_ARGS:-} --out "$RESULTS/chunked-$run-$setting" \
        > "$LOGS/chunked-$run-$setting.log" 2>&1
      echo "chunked prefill ($run, $setting): rc=$?"
    )
    grep -E "^\|" "$LOGS/chunked-$run-$setting.log" | grep -E "sparse|impl" | cut -c1-200
  done
fi

if [ "$PART" = engine-chunks ]; then
  for setting in ${SETTINGS:-hopper:1 hopper:16 hopper:128 triton:1}; do
    backend="${setting%%:*}" page="${setting##*:}"
    # shellcheck disable=SC2086  # CHUNKS is a list of sizes
    with_packages timeout 240 python3 benchmarks/chunked_prefill.py --chunks ${CHUNKS:-8192} --backend "$backend" \
      --page-size "$page" --uncarried --no-chunked-dense --no-error --host-ahead --repeats 5 --warmup 2 \
      --out "$RESULTS/engine-chunks-$backend-p$page" > "$LOGS/engine-chunks-$backend-p$page.log" 2>&1
    echo "engine chunks ($backend, page $page): rc=$?"
    grep -E "^\|" "$LOGS/engine-chunks-$backend-p$page.log" | grep -E "sparse|impl" | cut -c1-160
  done
fi

if [ "$PART" = no-tail ]; then
  sets=("FPV2_HOPPER_PERSISTENT=:FPV2_HOPPER_WORK_ORDER=" "FPV2_HOPPER_PERSISTENT=0:FPV2_HOPPER_WORK_ORDER=0")
  for shape in "16384 1 114688" "8192 1 57344" "8192 1 122880" "8192 4 57344" "32768 1 0" "131072 1 0"; do
    read -r seqlen batch prefix <<< "$shape"
    with_packages timeout 150 python3 benchmarks/attention_switch_probe.py --env-sets "${sets[@]}" \
      --seqlen "$seqlen" --batch "$batch" --prefix "$prefix" --modes mean --rounds 10 --calls 5 \
      --dense-tail-tiles 0 --label "L$seqlen-B$batch-P$prefix-T0" >> "$RESULTS/no-tail.jsonl" \
      2> "$LOGS/no-tail-$seqlen-$batch-$prefix.log"
    echo "probe L=$seqlen B=$batch prefix=$prefix: rc=$?"
  done
  settings_table "$RESULTS/no-tail.jsonl"
fi

if [ "$PART" = triton-order ]; then
  triton_order_probes triton-order 200 "16384 1 114688 1" "8192 1 57344 1" "8192 4 57344 1" "8192 1 0 1" \
    "32768 1 0 1" "131072 1 0 1" "16384 1 114688 0"
fi

if [ "$PART" = chunk-attention ]; then
  for setting in ${SETTINGS:-default decoded}; do
    assignments=()
    [ "$setting" = decoded ] && assignments=(FPV2_HOPPER_PERSISTENT=0 FPV2_HOPPER_WORK_ORDER=0)
    [ "$setting" = unfused ] && assignments=(FPV2_CHUNKED_FUSED_TILE_COPY=0)
    env "${assignments[@]}" PYTHONPATH="$(ls -d "$ROOT"/packages/*/src | tr '\n' ':')" \
      FPV2_KERNEL_LIBRARY="$ROOT/$BIN/libfpv2_kernel.so" timeout 240 python3 benchmarks/chunk_attention_probe.py \
      --seqlen 131072 --chunk 8192 --rounds 5 --calls 3 --out "$RESULTS/chunk-attention-$setting.jsonl" \
      > "$RESULTS/chunk-attention-$setting.txt" 2> "$LOGS/chunk-attention-$setting.log"
    echo "chunk attention probe ($setting): rc=$?"
    cat "$RESULTS/chunk-attention-$setting.txt"
  done
fi

if [ "$PART" = triton-order-kernel ]; then
  with_packages timeout 120 python3 benchmarks/work_order_speed.py --segments 2048 4096 16384 32768 \
    > "$RESULTS/work-order-speed.jsonl" 2> "$LOGS/work-order-speed.log"
  echo "work order speed: rc=$?"
  cat "$RESULTS/work-order-speed.jsonl"
  triton_order_probes triton-order-kernel 150 "16384 1 114688 1" "16384 1 114688 0" "8192 1 57344 0" \
    "2048 1 129024 1" "8192 1 0 1"
fi

if [ "$PART" = triton-fresh-order ]; then
  triton_order_probes triton-fresh-order 150 "8192 1 0 1" "32768 1 0 1" "131072 1 0 1" "32768 4 0 1"
fi

if [ "$PART" = chunk-host ]; then
  run=0
  for tree in ${TREES:-.}; do  # folders holding a packages/ tree; a tree named twice runs twice (A B A B)
    run=$((run + 1))
    for page in ${PAGES:-1}; do
      for mode in ${MODES:-aware naive}; do
        flag=()
        [ "$mode" = naive ] && flag=(--naive)
        [ "$mode" = uncarried ] && flag=(--uncarried)
        name="chunk-host-$mode"
        [ -n "${PAGES:-}" ] && name="$name-p$page"
        [ -n "${TREES:-}" ] && name="$name-$run-$([ "$tree" = . ] && echo tree || basename "$tree")"
        SRC_TREE="$(cd "$tree" && pwd)" with_packages timeout 150 python3 benchmarks/chunk_host_profile.py \
          --backend hopper --page-size "$page" "${flag[@]}" > "$RESULTS/$name.txt" 2> "$LOGS/$name.log"
        echo "chunk host profile ($mode, page $page, tree $tree): rc=$?"
        head -1 "$RESULTS/$name.txt"
      done
    done
  done
fi

if [ "$PART" = triton-even ]; then
  sets=("FPV2_TRITON_WORK_ORDER=0" "FPV2_TRITON_WORK_ORDER=:FPV2_TRITON_ORDER_LIGHT_BLOCKS=0"
    "FPV2_TRITON_WORK_ORDER=:FPV2_TRITON_ORDER_LIGHT_BLOCKS=64")
  for shape in "16384 1 114688 1" "16384 1 114688 0" "8192 1 57344 0" "2048 1 129024 1" "8192 1 0 1"; do
    read -r seqlen batch prefix tail <<< "$shape"
    with_packages timeout 150 python3 benchmarks/attention_switch_probe.py --backend triton --env-sets "${sets[@]}" \
      --seqlen "$seqlen" --batch "$batch" --prefix "$prefix" --modes mean --rounds 6 --calls 3 \
      --dense-tail-tiles "$tail" --label "L$seqlen-B$batch-P$prefix-T$tail" >> "$RESULTS/triton-even.jsonl" \
      2> "$LOGS/triton-even-$seqlen-$batch-$prefix-$tail.log"
    echo "probe L=$seqlen B=$batch prefix=$prefix tail=$tail: rc=$?"
  done
  settings_table "$RESULTS/triton-even.jsonl"
fi

if [ "$PART" = suites ]; then
  gpu_tests kernel-suite 300 packages/fpv2-kernel/tests -m "gpu or hopper"
  gpu_tests serving-suite 240 packages/fpv2-serving/tests -m "gpu or hopper" \
    --deselect packages/fpv2-serving/tests/test_soak.py
fi

if [ "$PART" = chunk-profile ]; then
  ncu_locked chunk-one-per-tile "FPV2_HOPPER_PERSISTENT=0" --seqlen 16384 --prefix 114688
  ncu_locked chunk-queue-order "FPV2_HOPPER_PERSISTENT=dynamic:FPV2_HOPPER_WORK_ORDER=1" --seqlen 16384 --prefix 114688
fi

if [ "$PART" = order ]; then
  probe() {  # probe LABEL SWITCH SETTINGS: attention_switch_probe.py at 128K, off and mean, into order-probe.jsonl
    with_packages timeout 150 python3 benchmarks/attention_switch_probe.py --switch "$2" --settings "$3" \
      --seqlen 131072 --modes off,mean --rounds 8 --calls 3 --label "$1" >> "$RESULTS/order-probe.jsonl" \
      2> "$LOGS/probe-$1.log"
    echo "probe $1: rc=$?"
  }
  probe no-order FPV2_HOPPER_PERSISTENT 0,dynamic
  FPV2_HOPPER_WORK_ORDER=1 probe order FPV2_HOPPER_PERSISTENT 0,dynamic
  FPV2_HOPPER_PERSISTENT=dynamic probe dynamic FPV2_HOPPER_WORK_ORDER 0,1
  settings_table "$RESULTS/order-probe.jsonl"
fi

if [ "$PART" = combined ]; then
  default="FPV2_HOPPER_PERSISTENT=0"
  queued="FPV2_HOPPER_PERSISTENT=dynamic:FPV2_HOPPER_WORK_ORDER=1"
  for shape in "1 off,mean" "4 mean"; do
    read -r batch modes <<< "$shape"
    with_packages timeout 200 python3 benchmarks/attention_switch_probe.py --env-sets "$default" "$queued" \
      --seqlen 131072 --batch "$batch" --modes "$modes" --rounds 8 --calls 3 --label "B$batch" \
      >> "$RESULTS/combined-probe.jsonl" 2> "$LOGS/combined-b$batch.log"
    echo "probe B=$batch: rc=$?"
  done
  settings_table "$RESULTS/combined-probe.jsonl"
  ab_rows_128k default "" queued "FPV2_HOPPER_PERSISTENT=dynamic FPV2_HOPPER_WORK_ORDER=1"
fi

if [ "$PART" = land-default ]; then
  gpu_tests queue 240 packages/fpv2-kernel/tests/test_hopper_kernel.py -m hopper -k "tile_queue or work_order"
  gpu_tests kernel-suite 300 packages/fpv2-kernel/tests -m "gpu or hopper"
  ab_rows_128k default "" one-per-tile FPV2_HOPPER_PERSISTENT=0
fi

if [ "$PART" = sizes ]; then
  default="FPV2_HOPPER_PERSISTENT=0"
  queued="FPV2_HOPPER_PERSISTENT=dynamic:FPV2_HOPPER_WORK_ORDER=1"
  for shape in "8192 1 0 mean" "32768 1 0 off,mean" "65536 1 0 mean" "32768 4 0 mean" "16384 1 114688 mean"; do
    read -r seqlen batch prefix modes <<< "$shape"
    with_packages timeout 150 python3 benchmarks/attention_switch_probe.py --env-sets "$default" "$queued" \
      --seqlen "$seqlen" --batch "$batch" --prefix "$prefix" --modes "$modes" --rounds 10 --calls 5 \
      --label "L$seqlen-B$batch-P$prefix" >> "$RESULTS/sizes-probe.jsonl" 2> "$LOGS/sizes-$seqlen-$batch-$prefix.log"
    echo "probe L=$seqlen B=$batch prefix=$prefix: rc=$?"
  done
  settings_table "$RESULTS/sizes-probe.jsonl"
fi

if [ "$PART" = threshold ] || [ "$PART" = prefixes ]; then
  shapes=("16384 1 114688 off,mean" "8192 1 122880 mean" "8192 1 57344 mean" "4096 1 126976 mean" "16384 1 0 mean"
    "8192 1 0 mean" "8192 4 0 mean")
  if [ "$PART" = prefixes ]; then
    shapes=("8192 1 8192 mean" "8192 1 24576 mean" "2048 1 129024 mean" "8192 4 57344 mean" "32768 1 98304 mean"
      "24576 1 0 mean" "32768 1 0 mean")
  fi
  sets=("FPV2_HOPPER_PERSISTENT=0" "FPV2_HOPPER_PERSISTENT=0:FPV2_HOPPER_WORK_ORDER=1" "FPV2_HOPPER_PERSISTENT=dynamic"
    "FPV2_HOPPER_PERSISTENT=dynamic:FPV2_HOPPER_WORK_ORDER=1")
  for shape in "${shapes[@]}"; do
    read -r seqlen batch prefix modes <<< "$shape"
    with_packages timeout 150 python3 benchmarks/attention_switch_probe.py --env-sets "${sets[@]}" \
      --seqlen "$seqlen" --batch "$batch" --prefix "$prefix" --modes "$modes" --rounds 10 --calls 5 \
      --label "L$seqlen-B$batch-P$prefix" >> "$RESULTS/$PART-probe.jsonl" 2> "$LOGS/$PART-$seqlen-$batch-$prefix.log"
    echo "probe L=$seqlen B=$batch prefix=$prefix: rc=$?"
  done
  settings_table "$RESULTS/$PART-probe.jsonl"
fi
