/*
 * io-impl.h - internal API of src/io: entry points of the readers of outside
 * data that parse from memory instead of a file, so that the fuzz targets
 * (fuzz/) and the corpus regression test reach exactly the validation code
 * the file readers run. Anything here is not API.
 */
#ifndef FSDP_IO_IMPL_H
#define FSDP_IO_IMPL_H

#include "core/core-impl.h"

/* ---- JSON files (json.c) ---- */
struct cJSON;
/* Parses text[0..len), the file `name` read as `what` ("model config"), as
 * one JSON value followed by nothing but JSON white space: invalid JSON, a
 * NUL byte, or bytes after the value (a second object, junk) are
 * FSDP_ERR_FORMAT naming `what`, the file and the byte offset. text is
 * borrowed; *out is returned to the caller to cJSON_Delete. COLLECTIVE: no. */
enum fsdp_status fsdp__json_parse(struct fsdp_ctx *ctx, const char *what, const char *name, const char *text,
                                  size_t len, struct cJSON **out);

/* ---- Token sources (data.c) ---- */
/* fsdp_data_open on the bytes buf[0..len) as if they were the file `name`
 * (the name picks the format as in [Note: telling token files apart] and
 * appears in messages). The bytes are copied into an aligned block the data
 * owns, so buf is only borrowed for the call. *out is returned to the caller
 * to free with fsdp_data_free. COLLECTIVE: no. */
enum fsdp_status fsdp__data_open_mem(struct fsdp_ctx *ctx, const char *name, const void *buf,
                                     size_t len, int vocab_size, struct fsdp_data **out);

/* ---- GPT-2's byte-level BPE (bpe.c, bpe_load.c; their shared internals: bpe-impl.h) ---- */
/* (bpe_load.c) fsdp_bpe_open on files already in memory (borrowed for the call): GPT-2's
 * encoder.json + vocab.bpe, or a Hugging Face tokenizer.json; the names
 * appear in messages. *out is returned to free with fsdp_bpe_free. */
enum fsdp_status fsdp__bpe_from_gpt2(struct fsdp_ctx *ctx, const char *enc_name, const void *enc,
                                     size_t enc_len, const char *bpe_name, const void *merges,
                                     size_t merges_len, struct fsdp_bpe **out);
enum fsdp_status fsdp__bpe_from_hf(struct fsdp_ctx *ctx, const char *name, const void *buf, size_t len,
                                   struct fsdp_bpe **out);
/* The two merge algorithms of [Note: merge passes] in bpe.c on one piece
 * s[0..n), for tests that compare them: ids holds n entries; no cache. The
 * array one takes pieces of at most 48 bytes (else returns -1). */
int fsdp__bpe_merge_short(const struct fsdp_bpe *b, const uint8_t *s, size_t n, int32_t *ids);
enum fsdp_status fsdp__bpe_merge_long(struct fsdp_bpe *b, const uint8_t *s, size_t n, int32_t *ids,
                                      size_t *n_out);
/* Cuts text[0..len) into GPT-2's pre-tokenizer pieces: writes the end of
 * each (at most cap) to ends; returns how many. */
size_t fsdp__bpe_pieces(const void *text, size_t len, size_t *ends, size_t cap);
/* The pre-tokenizer class of a code point: 0 other, 1 \p{L}, 2 \p{N}, 3 \s. */
int fsdp__bpe_class(int32_t cp);

/* ---- safetensors (reader: safetensors.c; writer: st_write.c) ---- */
/* A file is: 8-byte little-endian header length H, H bytes of JSON
 * {"name": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}, ...,
 *  "__metadata__": {"k": "v"}} padded with spaces to a multiple of 8, then the
 * data section; offsets are relative to its start. Our writer adds metadata
 * "fsdp.crc32c.<name>": one 8-hex-digit CRC-32C per FSDP__ST_CHUNK bytes of
 * the tensor, which readers verify for every chunk they touch
 * ([Note: chunked checksums] in safetensors.c). */
#define FSDP__ST_CHUNK ((uint64_t)1 << 20)
#define FSDP__ST_CRC_KEY "fsdp.crc32c." /* + the tensor's name: its checksums */
/* The checksums of a tensor of `bytes` bytes (one for an empty tensor). */
static inline int64_t fsdp__st_chunks(uint64_t bytes) {
    return bytes == 0 ? 1 : (int64_t)((bytes + FSDP__ST_CHUNK - 1) / FSDP__ST_CHUNK);
}
#define FSDP__ST_MAX_HEADER ((uint64_t)100 << 20)

struct fsdp__st_tensor {
    char *name;
    enum fsdp_dtype dtype;
    int ndim;
    int64_t shape[FSDP_MAX_DIMS];
    int64_t numel;
    uint64_t begin, end;   /* byte offsets in the data section */
    uint32_t *crc;         /* (n_crc) per-chunk CRC-32C, or NULL (not our file) */
    int64_t n_crc;
};

struct fsdp__st_file {
    char *path;            /* for messages */
    int fd;                /* -1 when parsed from memory */
    uint64_t file_size, data_start;
    uint32_t header_crc;   /* fsdp__st_open: CRC-32C of the first data_start bytes ([Note: files of one save]) */
    int n;
    struct fsdp__st_tensor *t; /* (n) sorted by begin */
    int n_meta;
    char **meta_key, **meta_val; /* other __metadata__ entries */
};

/* Parses and validates the header in buf[0..len) (the first len bytes of a
 * file of file_size bytes; len >= 8 + H is needed) as the file `name`. Every
 * field is checked: header length, JSON, dtype, shape, offsets in range,
 * sizes consistent with shape, no overlap, no duplicate names, checksum
 * metadata. On failure the message names `name` and the tensor. Fills *out
 * (caller frees with fsdp__st_close). COLLECTIVE: no. */
enum fsdp_status fsdp__safetensors_parse(struct fsdp_ctx *ctx, const char *name, const void *buf,
                                         size_t len, uint64_t file_size, struct fsdp__st_file *out);
/* Opens and parses a file; reads nothing of the data. */
enum fsdp_status fsdp__st_open(struct fsdp_ctx *ctx, const char *path, struct fsdp__st_file *out);
void fsdp__st_close(struct fsdp__st_file *f);
int fsdp__st_find(const struct fsdp__st_file *f, const char *name); /* index or -1 */
const char *fsdp__st_meta(const struct fsdp__st_file *f, const char *key); /* NULL if absent */
/* Reads bytes [lo, hi) of tensor i into dst, verifying the checksum of every
 * chunk it touches (it reads whole chunks). */
enum fsdp_status fsdp__st_read(struct fsdp_ctx *ctx, const struct fsdp__st_file *f, int i,
                               uint64_t lo, uint64_t hi, void *dst);
/* Reads every tensor and verifies every checksum; *n_unchecked counts tensors
 * without one. */
enum fsdp_status fsdp__st_verify(struct fsdp_ctx *ctx, const struct fsdp__st_file *f,
                                 int *n_unchecked);
enum fsdp_status fsdp__st_dtype_parse(const char *s, enum fsdp_dtype *out);
const char *fsdp__st_dtype_str(enum fsdp_dtype dt);

/* The writer: declare every tensor up front, then stream their bytes in
 * declaration order; commit checks sizes, writes the checksums into the
 * header, fsyncs and renames `path.tmp` to `path` (then fsyncs the folder),
 * so `path` is either the old file or the complete new one. */
struct fsdp__st_desc {
    const char *name;
    enum fsdp_dtype dtype;
    int ndim;
    int64_t shape[FSDP_MAX_DIMS];
};
struct fsdp__st_writer;
/* The check fsdp__st_writer_open runs before it writes anything: `path` and
 * `path.tmp` are each absent or a file this writer made, `path` with the
 * metadata key `mark` (NULL: any) where it exists ([Note: replace only our
 * own files]); otherwise FSDP_ERR_INVALID (or FSDP_ERR_IO) naming the file.
 * For callers that check an output path long before writing it. */
enum fsdp_status fsdp__st_check_target(struct fsdp_ctx *ctx, const char *path, const char *mark);
enum fsdp_status fsdp__st_writer_open(struct fsdp_ctx *ctx, const char *path, int n,
                                      const struct fsdp__st_desc *desc, int n_meta,
                                      const char *const *meta_kv, struct fsdp__st_writer **out);
/* Appends bytes of the current tensor (tensors fill in declaration order). */
enum fsdp_status fsdp__st_writer_write(struct fsdp__st_writer *w, const void *data, size_t bytes);
enum fsdp_status fsdp__st_writer_commit(struct fsdp__st_writer *w); /* frees w */
void fsdp__st_writer_abort(struct fsdp__st_writer *w);              /* frees w; NULL ok */
/* 1 if path is a regular file this writer made (its header carries our
 * checksums: [Note: replace only our own files]), or with allow_empty an
 * empty one (a crashed writer's ".tmp"), else 0. */
int fsdp__st_written_by_us(const char *path, int allow_empty);
/* Byte offset of tensor i's data in the file, as the writer lays it out. */
uint64_t fsdp__st_writer_data_start(const struct fsdp__st_writer *w);

/* ---- Durable files (st_write.c; CRC-32C: safetensors.c) ---- */
uint32_t fsdp__crc32c(uint32_t crc, const void *buf, size_t n);
/* Writes all of buf at offset (pwrite, retrying short writes). */
enum fsdp_status fsdp__write_all(struct fsdp_ctx *ctx, int fd, const char *path, const void *buf,
                                 size_t n, uint64_t off);
enum fsdp_status fsdp__fsync_dir(struct fsdp_ctx *ctx, const char *dir_of_path);
/* Test hook for crash safety: when the environment sets FSDP_CKPT_CRASH_AT=k,
 * the k-th call (counting from 1) in this process ends it at once with
 * _exit(86), as a kill -9 would, leaving whatever is on disk. */
void fsdp__ckpt_crash_point(const char *where);

#endif
