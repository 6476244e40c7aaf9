/*
 * fpv2.h -- the stable C ABI of libfpv2_kernel (block-sparse paged prefill attention).
 *
 * Pure C (C99), torch-free, callable from any engine or language.
 *
 * Stability rules
 *   - FPV2_ABI_VERSION_MAJOR changes break the ABI; FPV2_ABI_VERSION_MINOR changes only
 *     append: new functions, new fields at the END of the size-prefixed structs, new flag bits.
 *   - Every argument struct starts with `uint32_t struct_size`; set it to sizeof(the struct)
 *     as compiled against your header. A library refuses a struct smaller than its own
 *     (an older caller of a newer major layout); a larger one (a caller built against a newer
 *     minor) is accepted and the unknown tail fields are ignored.
 *   - Only symbols starting with `fpv2_` are exported.
 *
 * Conventions
 *   - Tensors are raw pointers (device memory for the kernel) plus explicit shape, strides
 *     (in ELEMENTS, not bytes) and a dtype code. Validation reads metadata only: no function
 *     ever dereferences a tensor's data pointer, so validation works on host or device memory.
 *   - Every function returning int32_t returns an fpv2_status_t code, never aborts the process,
 *     and sets the calling thread's last-error message (fpv2_get_last_error): a description
 *     of the failure, or "" when the call succeeded.
 */
#ifndef FPV2_FPV2_H_
#define FPV2_FPV2_H_

#include <stddef.h>
#include <stdint.h>

#define FPV2_ABI_VERSION_MAJOR 1
#define FPV2_ABI_VERSION_MINOR 5

#if defined(_WIN32)
#define FPV2_API
#else
#define FPV2_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------------------------------
 * Status codes (int32_t). */
typedef enum fpv2_status_t {
  FPV2_OK = 0,
  FPV2_ERROR_INVALID_ARGUMENT = 1,   /* malformed or inconsistent arguments */
  FPV2_ERROR_UNSUPPORTED = 2,        /* well-formed, but a configuration this library does not handle */
  FPV2_ERROR_NOT_BUILT = 3,          /* the requested kernel is not part of this build */
  FPV2_ERROR_CUDA = 4,               /* a CUDA runtime/driver call failed */
  FPV2_ERROR_WORKSPACE_TOO_SMALL = 5,/* workspace_bytes below what the call needs */
  FPV2_ERROR_INTERNAL = 6            /* a bug or an exhausted host resource */
} fpv2_status_t;

/* ------------------------------------------------------------------------------------------------
 * Element types (int32_t codes). */
typedef enum fpv2_dtype_t {
  FPV2_DTYPE_INVALID = 0,
  FPV2_DTYPE_F16 = 1,
  FPV2_DTYPE_BF16 = 2,
  FPV2_DTYPE_F32 = 3,
  FPV2_DTYPE_E4M3 = 4, /* float8_e4m3fn */
  FPV2_DTYPE_I32 = 5,
  FPV2_DTYPE_I64 = 6
} fpv2_dtype_t;

/* Highest tensor rank an fpv2_tensor_t describes. */
#define FPV2_MAX_NDIM 4

/* A strided tensor view. Strides count elements. An OPTIONAL tensor is absent when
 * data == NULL and ndim == 0 (all-zero struct). A required tensor with zero elements may
 * have data == NULL. */
typedef struct fpv2_tensor_t {
  const void* data;
  int32_t dtype; /* fpv2_dtype_t */
  int32_t ndim;  /* 0..FPV2_MAX_NDIM */
  int64_t shape[FPV2_MAX_NDIM];
  int64_t strides[FPV2_MAX_NDIM];
} fpv2_tensor_t;

/* ------------------------------------------------------------------------------------------------
 * Paged prefill batch (mirrors fpv2.kernel.contracts.PagedPrefillBatch).
 *
 * Request b owns queries cu_seqlens_q[b]..cu_seqlens_q[b+1] of the packed query tensor and
 * seqlens_k[b] keys (cached prefix included); token i lives at
 * (page_table[b][i / page_size], i % page_size) of the cache. Causal alignment is
 * bottom-right: query i sits at absolute position seqlens_k[b] - q_len_b + i.
 * The host-side scalars (total_q, max_seqlen_*) let the library check shapes without
 * reading device memory. */
typedef struct fpv2_paged_batch_t {
  uint32_t struct_size;       /* sizeof(fpv2_paged_batch_t) */
  int32_t num_requests;       /* B >= 1 */
  fpv2_tensor_t cu_seqlens_q; /* (B+1,) I32, contiguous */
  fpv2_tensor_t seqlens_k;    /* (B,) I32, contiguous */
  fpv2_tensor_t page_table;   /* (B, max_pages) I32; row stride free, page stride 1 */
  int32_t page_size;          /* tokens per page, > 0 */
  int32_t num_pages;          /* pages in the KV cache, > 0 */
  int64_t total_q;            /* cu_seqlens_q[B] */
  int32_t max_seqlen_q;       /* max_b q_len_b */
  int32_t max_seqlen_k;       /* max_b seqlens_k[b] */
} fpv2_paged_batch_t;

/* ------------------------------------------------------------------------------------------------
 * Block index in CSR form (mirrors fpv2.kernel.contracts.BlockIndex).
 *
 * Segment order: request, then KV head, then query tile. Segment
 * s = num_kv_heads * tile_offsets[b] + h * ntiles_b + t keeps the strictly ascending block
 * ids blocks[offsets[s] .. offsets[s+1]), in units of block_size KV tokens. A query tile is
 * tile_size consecutive PackGQA rows (row r = position r / group of query head
 * h * group + r % group); it must equal the kernel's tile (FPV2_KERNEL_TILE_SIZE). */
#define FPV2_KERNEL_TILE_SIZE 128

typedef struct fpv2_block_index_t {
  uint32_t struct_size; /* sizeof(fpv2_block_index_t) */
  int32_t num_kv_heads; /* Hkv */
  int32_t group;        /* Hq / Hkv the tiles were packed with */
  int32_t tile_size;    /* packed rows per query tile; must be FPV2_KERNEL_TILE_SIZE */
  int32_t block_size;   /* KV tokens per block, a power of two */
  fpv2_tensor_t offsets;      /* (S+1,) I32, contiguous */
  fpv2_tensor_t blocks;       /* (capacity >= nnz,) I32, contiguous; ids past offsets[S] are ignored */
  fpv2_tensor_t tile_offsets; /* (B+1,) I32, contiguous: cumulative tiles per request */
  int64_t num_segments;       /* S */
} fpv2_block_index_t;

/* ------------------------------------------------------------------------------------------------
 * Mean-correction plan (mirrors fpv2.kernel.contracts.CorrectionPlan and BlockStatistics).
 *
 * Block J of request b is row block_offsets[b] + J of the pooled tensors. A pruned block J of
 * a segment is corrected when it is fully visible to the tile's first row; the eligible range
 * is walked in chunks of chunk_size (= 64) blocks. When todo_offsets/todo_masks are given,
 * bit i of word w of segment s (todo_masks[todo_offsets[s] + w]) marks block w * 64 + i; when
 * absent the kernel derives the same bits from the block index (the Hopper kernel always derives
 * them). The pooled tensors are F32 or, since ABI 1.1, BF16 (both the same dtype); the Hopper
 * kernel reads BF16 only and refuses F32 with FPV2_ERROR_UNSUPPORTED, unless the E4M3 copies below
 * are given.
 *
 * Since ABI 1.2, optional E4M3 copies of the pooled statistics (all four tensors, or none) let the
 * Hopper kernel run the correction's pooled products on FP8 tensor cores (TMA path: page_size a
 * multiple of 128; refused with FPV2_ERROR_UNSUPPORTED otherwise). With them, pooled_k/pooled_v
 * may be F32 or BF16 and are not read by that kernel. Request b's block J is row
 * e4m3_offsets[b] + J of pooled_k_e4m3 and column e4m3_offsets[b] + FPV2_E4M3_SLOT(J) of
 * pooled_vt_e4m3; every offset is a multiple of 16 and the rows or columns between requests hold
 * zeros. The slot order inside each group of 16 blocks is the order in which the kernel's FP8
 * accumulator registers are reused as the A operand of the P x V product: slot 4t + i holds block
 * 2t + i (i < 2) or 8 + 2t + i - 2 (i >= 2). Values are e4m3 x scale (e4m3_scales[b][h][0] for K,
 * [1] for V). A struct_size of the ABI 1.1 struct (FPV2_CORRECTION_PLAN_SIZE_V1_1) is accepted: the
 * E4M3 copies are then absent.
 *
 * Since ABI 1.5, an optional key spread (key_variance and key_radius, both or neither) asks for the
 * second-order mass shift: pooled block J of KV head h then gains, besides log|B_J|, the logit
 * min(scale^2 |q|^2 key_variance[J][h] / 2, scale |q| key_radius[J][h]) for query row q in real units
 * (fpv2.kernel.reference.mass_shift). The Hopper kernel keeps two 16-bit values per pooled row beside its
 * shift table, so it serves requests of at most half the blocks it marks without the spread (refused
 * with FPV2_ERROR_UNSUPPORTED beyond). A struct_size of the ABI 1.2 struct
 * (FPV2_CORRECTION_PLAN_SIZE_V1_2) is accepted: the spread is then absent. */
#define FPV2_E4M3_SLOT(J) \
  (((J) & ~15) + (((J) & 15) < 8 ? 4 * (((J) & 15) >> 1) + ((J) & 1) : 4 * ((((J) & 15) - 8) >> 1) + 2 + ((J) & 1)))
#define FPV2_CORRECTION_CHUNK 64

typedef struct fpv2_correction_plan_t {
  uint32_t struct_size; /* sizeof(fpv2_correction_plan_t) */
  int32_t chunk_size;   /* must be FPV2_CORRECTION_CHUNK */
  int32_t block_size;   /* must equal the block index's block_size */
  fpv2_tensor_t pooled_k;      /* (total_blocks, Hkv, d) F32 | BF16, contiguous */
  fpv2_tensor_t pooled_v;      /* (total_blocks, Hkv, d) pooled_k's dtype, contiguous */
  fpv2_tensor_t block_lengths; /* (total_blocks,) I32, contiguous */
  fpv2_tensor_t block_offsets; /* (B+1,) I32, contiguous */
  fpv2_tensor_t todo_offsets;  /* optional, (S+1,) I32, contiguous */
  fpv2_tensor_t todo_masks;    /* optional, (num_words,) I64, contiguous */
  /* ABI 1.2: optional E4M3 copies (see above); all four present or all absent. rows >= the last
   * request's e4m3_offsets[B - 1] + its blocks, a multiple of 16. */
  fpv2_tensor_t pooled_k_e4m3;  /* (rows, Hkv, d) E4M3, contiguous */
  fpv2_tensor_t pooled_vt_e4m3; /* (Hkv, d, rows) E4M3, contiguous */
  fpv2_tensor_t e4m3_offsets;   /* (B+1,) I32, contiguous, multiples of 16 */
  fpv2_tensor_t e4m3_scales;    /* (B, Hkv, 2) F32, contiguous: K scale, V scale */
  /* ABI 1.5: optional key spread of the second-order mass shift (see above); both present or both absent. */
  fpv2_tensor_t key_variance;   /* (total_blocks, Hkv) F32, contiguous: per-dimension key variance */
  fpv2_tensor_t key_radius;     /* (total_blocks, Hkv) F32, contiguous: largest key distance from the mean */
} fpv2_correction_plan_t;

/* sizeof(fpv2_correction_plan_t) in ABI 1.1 (before the E4M3 copies). */
#define FPV2_CORRECTION_PLAN_SIZE_V1_1 ((uint32_t)offsetof(fpv2_correction_plan_t, pooled_k_e4m3))
/* sizeof(fpv2_correction_plan_t) in ABI 1.2 to 1.4 (before the key spread). */
#define FPV2_CORRECTION_PLAN_SIZE_V1_2 ((uint32_t)offsetof(fpv2_correction_plan_t, key_variance))

/* ------------------------------------------------------------------------------------------------
 * Arguments of one prefill call. */

/* Causal (bottom-right aligned) attention. Required: only causal prefill exists. */
#define FPV2_PREFILL_CAUSAL 1u

typedef struct fpv2_prefill_args_t {
  uint32_t struct_size; /* sizeof(fpv2_prefill_args_t) */
  uint32_t flags;       /* FPV2_PREFILL_* bits; FPV2_PREFILL_CAUSAL must be set */
  fpv2_tensor_t q;       /* (total_q, Hq, d) F16 | BF16 | E4M3, inner stride 1 */
  fpv2_tensor_t k_cache; /* (num_pages, page_size, Hkv, d), q's dtype, inner stride 1 */
  fpv2_tensor_t v_cache; /* like k_cache */
  fpv2_tensor_t out;     /* (total_q, Hq, d), q's dtype (BF16 for E4M3 inputs), inner stride 1 */
  fpv2_tensor_t lse;     /* optional, (total_q, Hq) F32, inner stride 1 */
  const fpv2_paged_batch_t* batch;           /* required */
  const fpv2_block_index_t* index;           /* NULL: dense causal attention */
  const fpv2_correction_plan_t* correction;  /* NULL: no mean correction (needs an index) */
  fpv2_tensor_t q_descale; /* (B, Hkv) F32, contiguous: required iff q/k/v are E4M3, else absent */
  fpv2_tensor_t k_descale;
  fpv2_tensor_t v_descale;
  float softmax_scale;      /* 0 selects 1/sqrt(d) */
  int32_t device;           /* CUDA device ordinal of the tensors, or -1 for the current device */
  void* stream;             /* cudaStream_t; NULL is the default stream */
  void* workspace;          /* caller-provided device scratch memory (may be NULL if 0 bytes) */
  uint64_t workspace_bytes; /* size of workspace */
} fpv2_prefill_args_t;

/* ------------------------------------------------------------------------------------------------
 * Block scoring and selection of the index stage (ABI 1.4; mirrors fpv2.index's fused Triton pass).
 *
 * For every segment s (request b, KV head h, query tile t; the block index's order) the call scores the
 * tile's packed query rows against the request's pooled keys J = 0 .. num_scored - 1 (the blocks that
 * end at or before the tile's last position), num_scored = (last + 1) / block_size, in log2 units:
 * L_J = log2(sum over the rows r that see J of 2^(q_r . keys[block_offsets[b] + J, h])), row r seeing J
 * when J * block_size <= its position. It keeps J when 2^(L_J - max_J L_J) >= alpha, or when J is forced
 * (J < sink_blocks; J in the window of window_tokens before the tile's first position; J at or after the
 * tile's first diagonal block), or when the tile is dense (one of the request's last dense_tail_tiles
 * tiles, or seqlens_k[b] < min_sparse_kv_len), and only J < the tile's visible blocks. It writes:
 *   keep_bits[s][w]: bit i of word w marks block 32 w + i, words 0 .. 2 * ceil(visible / 64) - 1;
 *   counts[s]: kept blocks of the segment;
 *   offsets: [0, cumsum(counts)] (S + 1 values); tile_offsets: [0, cumsum(tiles of each request)].
 * No host synchronisation: the call enqueues two kernels on `stream`. Keys come prescaled by
 * softmax_scale * log2(e) and cast to q's dtype (fpv2.index's prepared keys). Hopper (sm_90a) only;
 * tile_size must be FPV2_KERNEL_TILE_SIZE and every row of a tile is scored (no probe stride). */
typedef struct fpv2_score_args_t {
  uint32_t struct_size;         /* sizeof(fpv2_score_args_t) */
  int32_t num_requests;         /* B >= 1 */
  fpv2_tensor_t q;              /* (total_q, Hq, d) F16 | BF16, inner stride 1; d in {64, 128} */
  fpv2_tensor_t keys;           /* (total_blocks, Hkv, d) q's dtype, contiguous */
  fpv2_tensor_t cu_seqlens_q;   /* (B+1,) I32, contiguous */
  fpv2_tensor_t seqlens_k;      /* (B,) I32, contiguous */
  fpv2_tensor_t block_offsets;  /* (B+1,) I32, contiguous: first pooled row of each request */
  fpv2_tensor_t tile_offsets;   /* output, (B+1,) I32, contiguous */
  fpv2_tensor_t offsets;        /* output, (S+1,) I32, contiguous */
  fpv2_tensor_t counts;         /* output, (S,) I32, contiguous */
  fpv2_tensor_t keep_bits;      /* output, (S, words) I32, inner stride 1, words >= 2 * ceil(max_blocks / 64) */
  int32_t group;                /* Hq / Hkv */
  int32_t tile_size;            /* must be FPV2_KERNEL_TILE_SIZE */
  int32_t block_size;           /* KV tokens per key block, a power of two */
  int32_t max_blocks;           /* max_b ceil(seqlens_k[b] / block_size) (host-known) */
  int64_t num_tiles;            /* sum_b ceil(q_len_b * group / tile_size); S = Hkv * num_tiles */
  float alpha;                  /* threshold ratio, finite and >= 0 */
  int32_t sink_blocks;          /* leading blocks always kept */
  int32_t window_tokens;        /* tokens before the tile's first position always kept */
  int32_t dense_tail_tiles;     /* last tiles of each request kept dense */
  int32_t min_sparse_kv_len;    /* requests with fewer keys are kept dense */
  int32_t device;               /* CUDA device ordinal of the tensors, or -1 for the current device */
  void* stream;                 /* cudaStream_t; NULL is the default stream */
} fpv2_score_args_t;

/* ------------------------------------------------------------------------------------------------
 * Functions. */

/* The ABI version this library implements. Either pointer may be NULL. */
FPV2_API void fpv2_get_abi_version(int32_t* major, int32_t* minor);

/* A static, human-readable description of the build (compiler, CUDA archs, CUTLASS version,
 * which kernels are present). */
FPV2_API const char* fpv2_get_build_info(void);

/* A static name and description of a status code ("unknown status" for unknown codes). */
FPV2_API const char* fpv2_status_string(int32_t status);

/* The message of the last status-returning fpv2_ call on THIS thread: "" if it succeeded.
 * The pointer stays valid until the next fpv2_ call on this thread. Query functions
 * (version, build info, status string, availability) leave it unchanged. */
FPV2_API const char* fpv2_get_last_error(void);

/* Metadata checks (no device memory is read). */
FPV2_API int32_t fpv2_validate_paged_batch(const fpv2_paged_batch_t* batch);
FPV2_API int32_t fpv2_validate_block_index(const fpv2_block_index_t* index, const fpv2_paged_batch_t* batch);
FPV2_API int32_t fpv2_validate_correction_plan(const fpv2_correction_plan_t* plan, const fpv2_paged_batch_t* batch);
FPV2_API int32_t fpv2_validate_prefill(const fpv2_prefill_args_t* args);

/* 1 if this build contains the Hopper (sm_90a) attention kernel, else 0. */
FPV2_API int32_t fpv2_hopper_kernel_available(void);

/* Block-sparse (or dense) causal paged prefill. Validates args first; returns
 * FPV2_ERROR_NOT_BUILT when the kernel is not part of this build.
 * Split-KV (ABI 1.3): when the call has too few query tiles to fill the GPU (a short chunk after a
 * long cached prefix, small batches), the kernel splits each tile's KV blocks over several CTAs and
 * merges their partial rows; it does so only when args->workspace holds at least the bytes that
 * fpv2_prefill_workspace_size reports (else it runs one CTA per tile: the same result). With the
 * work order (environment FPV2_HOPPER_WORK_ORDER, or the default below) calls that do not split use it for the tiles
 * sorted by kept-block work, heaviest first; with the dynamic tile queue of the persistent CTAs
 * (FPV2_HOPPER_PERSISTENT=dynamic) its first 256 bytes hold the queue's counter, and a call without
 * them is refused (FPV2_ERROR_WORKSPACE_TOO_SMALL). With FPV2_HOPPER_PERSISTENT and
 * FPV2_HOPPER_WORK_ORDER both unset, block-sparse calls at d = 128 on TMA pages (bf16 mean correction
 * or none) run the work order when they are chunks after a cached prefix with more tiles than SMs, and
 * the tile queue in the work order when a request has at least 6144 query tiles over its KV heads, if
 * the workspace holds what that needs, else one CTA per tile in the decoded order (the same result).
 * The workspace must be 256-byte aligned and may be reused once the call's stream is past it. */
FPV2_API int32_t fpv2_prefill(const fpv2_prefill_args_t* args);

/* ABI 1.3: the workspace bytes fpv2_prefill would use for args (0 when it would neither split, order
 * the tiles by work nor feed persistent CTAs from the dynamic tile queue);
 * args->workspace is not read. Validates args like fpv2_prefill (the same refusals); 0 bytes and
 * FPV2_OK when the kernel is not part of this build. */
FPV2_API int32_t fpv2_prefill_workspace_size(const fpv2_prefill_args_t* args, uint64_t* bytes);

/* ABI 1.4: the index stage's block scoring and selection (fpv2_score_args_t). Validates args first;
 * FPV2_ERROR_UNSUPPORTED for a configuration the kernel does not serve (head dim, dtype, more than 16384
 * key blocks), FPV2_ERROR_NOT_BUILT when the Hopper code is not part of this build. */
FPV2_API int32_t fpv2_score_blocks(const fpv2_score_args_t* args);

/* ABI 1.4: the metadata checks of fpv2_score_blocks alone (no device memory is read, nothing launched). */
FPV2_API int32_t fpv2_validate_score_blocks(const fpv2_score_args_t* args);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* FPV2_FPV2_H_ */
