/* kvdock._native: the few things Python does too slowly for kvdock's data plane.
 *
 * - copy_runs: copies of contiguous runs of bytes, split across threads, without the GIL (the
 *   copy engine, its streaming loops and its kept worker threads, is _copy.c);
 * - populate / blank: faulting a range of pages in, and replacing one with zero pages;
 * - pack_tokens: a list of Python ints as uint32 token ids, checked, in one pass;
 * - copy_grid: the copies between a tensor's chunks and pool slots, planned once per chunk;
 * - moved: the seqlock read side of a copy out of pool slots (their generations, read after it).
 *
 * A KV chunk is 2*L contiguous runs (one per K/V plane and layer) in a [2, L, T, D] tensor, and
 * one contiguous block in a pool slot. torch's copy_ of such strided views runs at 0.6-0.7x of
 * glibc's memcpy at the same thread count on our machines; this module hands each run to glibc's
 * memcpy (or a streaming loop) and splits the bytes evenly across a few threads (the calling
 * thread is one of them).
 *
 * The caller passes raw addresses (from tensors' data_ptr() and mapped buffers it keeps alive for
 * the call): nothing here checks that they are valid. kvdock.memcpy is the only caller of the
 * memory functions, kvdock.keys of pack_tokens.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "_copy.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

#define MAX_THREADS KVDOCK_MAX_THREADS

static int get_u64s(PyObject *obj, Py_buffer *view, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    const char *fmt = view->format ? view->format : "B";
    char kind = fmt[strlen(fmt) - 1]; /* after any byte-order mark */
    if (view->itemsize != 8 || view->len % 8 || !strchr("lLqQ", kind)) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous buffer of 64-bit integers", what);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(copy_runs_doc,
             "copy_runs(dst, src, run, threads, min_part, stream_min)\n\n"
             "Copy ``run`` bytes from each address of ``src`` to the address of ``dst`` at the same index\n"
             "(both uint64 buffers of one length), on up to ``threads`` threads, each given at least\n"
             "``min_part`` bytes, with non-temporal stores when ``stream_min`` bytes or more are copied\n"
             "in all. The GIL is released meanwhile.");

static PyObject *py_copy_runs(PyObject *self, PyObject *args) {
    PyObject *dst_obj, *src_obj;
    unsigned long long run, min_part, stream_min;
    int threads;
    if (!PyArg_ParseTuple(args, "OOKiKK", &dst_obj, &src_obj, &run, &threads, &min_part, &stream_min)) return NULL;
    Py_buffer dst, src;
    if (get_u64s(dst_obj, &dst, "dst") < 0) return NULL;
    if (get_u64s(src_obj, &src, "src") < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    if (dst.len != src.len) {
        PyErr_SetString(PyExc_ValueError, "dst and src must hold as many addresses");
    } else {
        Py_BEGIN_ALLOW_THREADS kvdock_copy_runs((const uint64_t *)dst.buf, (const uint64_t *)src.buf,
                                         (uint64_t)dst.len / 8, run, threads, min_part, stream_min);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(populate_doc,
             "populate(addr, nbytes, write)\n\n"
             "Map the pages of [addr, addr + nbytes) into the page tables now (madvise\n"
             "MADV_POPULATE_WRITE or _READ), so that later copies take no page faults. On kernels\n"
             "older than 5.14 it falls back to reading a byte of every page (never writing: the\n"
             "range may be shared), which maps private anonymous memory to the zero page only.\n"
             "The GIL is released meanwhile. OSError if the range is not mapped.");

static PyObject *py_populate(PyObject *self, PyObject *args) {
    unsigned long long addr, nbytes;
    int write;
    if (!PyArg_ParseTuple(args, "KKp", &addr, &nbytes, &write)) return NULL;
    long page = sysconf(_SC_PAGESIZE);
    uintptr_t start = (uintptr_t)addr & ~(uintptr_t)(page - 1);
    size_t len = (size_t)((uintptr_t)addr + nbytes - start);
    int rc, err = 0;
    Py_BEGIN_ALLOW_THREADS rc = madvise((void *)start, len, write ? MADV_POPULATE_WRITE : MADV_POPULATE_READ);
    if (rc != 0) err = errno;
    if (rc != 0 && err == EINVAL) { /* a kernel older than 5.14 */
        volatile const char *p = (volatile const char *)start;
        for (size_t at = 0; at < len; at += (size_t)page) (void)p[at];
        rc = 0;
    }
    Py_END_ALLOW_THREADS if (rc != 0) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(blank_doc,
             "blank(addr, nbytes)\n\n"
             "Replace the pages of [addr, addr + nbytes) (page-aligned, a mapping of this process) with\n"
             "read-only zero pages (mmap MAP_FIXED): whatever still points there reads zeros from now\n"
             "on, never what the old mapping shows later. OSError if the kernel refuses.");

static PyObject *py_blank(PyObject *self, PyObject *args) {
    unsigned long long addr, nbytes;
    if (!PyArg_ParseTuple(args, "KK", &addr, &nbytes)) return NULL;
    long page = sysconf(_SC_PAGESIZE);
    if (addr % (unsigned long long)page || nbytes % (unsigned long long)page) {
        PyErr_SetString(PyExc_ValueError, "blank needs a page-aligned range");
        return NULL;
    }
    void *at = mmap((void *)(uintptr_t)addr, (size_t)nbytes, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    if (at == MAP_FAILED) return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(pack_tokens_doc,
             "pack_tokens(seq)\n\n"
             "The items of a list or tuple of exact ints as little-endian uint32s (a bytearray), or None\n"
             "if any item is not an exact int (bools, numpy ints and floats are left to the caller).\n"
             "ValueError for an int outside 0 .. 2**32-1.");

static PyObject *py_pack_tokens(PyObject *self, PyObject *seq) {
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) Py_RETURN_NONE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyLong_CheckExact(items[i])) Py_RETURN_NONE;
    PyObject *out = PyByteArray_FromStringAndSize(NULL, n * 4);
    if (!out) return NULL;
    uint32_t *dst = (uint32_t *)PyByteArray_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(items[i], &overflow);
        if (overflow || v < 0 || v > 0xFFFFFFFFLL) {
            Py_DECREF(out);
            PyErr_SetString(PyExc_ValueError, "token id out of range 0..4294967295");
            return NULL;
        }
        dst[i] = (uint32_t)v; /* little-endian on every machine kvdock runs on (x86-64, arm64) */
    }
    return out;
}

PyDoc_STRVAR(copy_grid_doc,
             "copy_grid(base, step, chunks, slots, in_tensor, in_slot, run, taking, threads, min_part, stream_min)\n\n"
             "The copies between chunks of a tensor and pool slots, planned per chunk: chunk i of the\n"
             "tensor starts at ``base + chunks[i] * step``, its slot at ``slots[i]``, and each holds runs\n"
             "of ``run`` bytes at offsets ``in_tensor[k]`` / ``in_slot[k]`` (int64 buffers). Copies into\n"
             "the tensor when ``taking``, else into the slots, as copy_runs does (threads, streaming).\n"
             "The caller vouches that every address is valid and no two destination runs overlap.");

static PyObject *py_copy_grid(PyObject *self, PyObject *args) {
    unsigned long long base, step, run, min_part, stream_min;
    PyObject *objs[4];
    int taking, threads;
    if (!PyArg_ParseTuple(args, "KKOOOOKpiKK", &base, &step, &objs[0], &objs[1], &objs[2], &objs[3], &run, &taking,
                          &threads, &min_part, &stream_min))
        return NULL;
    Py_buffer b[4];
    int got = 0;
    for (; got < 4; got++)
        if (get_u64s(objs[got], &b[got], "grid") < 0) break;
    PyObject *result = NULL;
    uint64_t *dst = NULL, *src = NULL;
    if (got == 4) {
        uint64_t nc = (uint64_t)b[0].len / 8, nk = (uint64_t)b[2].len / 8, n = nc * nk;
        if (b[1].len != b[0].len || b[3].len != b[2].len) {
            PyErr_SetString(PyExc_ValueError, "chunks and slots, in_tensor and in_slot must have one item each");
        } else if (n && !((dst = PyMem_Malloc(n * 8)) && (src = PyMem_Malloc(n * 8)))) {
            PyErr_NoMemory();
        } else {
            const uint64_t *chunks = b[0].buf, *slots = b[1].buf, *in_t = b[2].buf, *in_s = b[3].buf;
            for (uint64_t i = 0; i < nc; i++)
                for (uint64_t k = 0; k < nk; k++) {
                    uint64_t t = base + chunks[i] * step + in_t[k], sl = slots[i] + in_s[k];
                    dst[i * nk + k] = taking ? t : sl;
                    src[i * nk + k] = taking ? sl : t;
                }
            Py_BEGIN_ALLOW_THREADS kvdock_copy_runs(dst, src, n, run, threads, min_part, stream_min);
            Py_END_ALLOW_THREADS result = Py_None;
            Py_INCREF(result);
        }
    }
    PyMem_Free(dst);
    PyMem_Free(src);
    for (int i = 0; i < got; i++) PyBuffer_Release(&b[i]);
    return result;
}

PyDoc_STRVAR(page_starts_doc,
             "page_starts(idx, out, page_size, capacity, distinct) -> (code, at)\n\n"
             "Checks that ``idx`` (int64 host indices) is whole pages of ``page_size`` consecutive\n"
             "slots and writes each page's first index into ``out`` (int64, one item a page). Returns\n"
             "(0, 0) when they are, each page inside ``[0, capacity)`` and starting at a multiple of\n"
             "``page_size``, and (with ``distinct``) no page named twice; else the first failed check,\n"
             "in this order over all pages: (1, page) not consecutive, (2, start) a start not a page of\n"
             "the pool, (3, start) a page named twice. One call for what takes several cold numpy\n"
             "operations (kvdock.integrations.sglang.pools.HostPages.starts).");

static PyObject *py_page_starts(PyObject *self, PyObject *args) {
    PyObject *idx_obj, *out_obj;
    long long page, capacity;
    int distinct;
    if (!PyArg_ParseTuple(args, "OOLLp", &idx_obj, &out_obj, &page, &capacity, &distinct)) return NULL;
    if (page <= 0 || capacity < 0) {
        PyErr_SetString(PyExc_ValueError, "page_size must be positive and capacity not negative");
        return NULL;
    }
    Py_buffer idx, out;
    if (get_u64s(idx_obj, &idx, "idx") < 0) return NULL;
    if (get_u64s(out_obj, &out, "out") < 0) {
        PyBuffer_Release(&idx);
        return NULL;
    }
    long long code = 0, at = 0;
    Py_ssize_t pages = out.len / 8;
    Py_ssize_t items = idx.len / 8;
    if (out.readonly || (pages ? items % pages || items / pages != page : items != 0)) {
        PyErr_SetString(PyExc_ValueError, "out must be writable, with one item per page of idx");
        code = -1;
    }
    const int64_t *ix = (const int64_t *)idx.buf;
    int64_t *starts = (int64_t *)out.buf;
    for (Py_ssize_t i = 0; code == 0 && i < pages; i++) {
        const int64_t *run = ix + i * page, first = run[0];
        for (long long j = 1; j < page; j++)
            if ((uint64_t)run[j] != (uint64_t)first + (uint64_t)j) { /* (unsigned: no overflow near INT64_MAX) */
                code = 1, at = i;
                break;
            }
        starts[i] = first;
    }
    for (Py_ssize_t i = 0; code == 0 && i < pages; i++)
        if (starts[i] < 0 || starts[i] % page || starts[i] > capacity - page) code = 2, at = starts[i];
    if (code == 0 && distinct && pages > 1) {
        size_t n = (size_t)(capacity / page), words = n / 64 + 1;
        uint64_t *seen = calloc(words, sizeof *seen);
        if (!seen) {
            PyErr_NoMemory();
            code = -1;
        }
        for (Py_ssize_t i = 0; seen && i < pages; i++) {
            size_t k = (size_t)(starts[i] / page);
            if (seen[k / 64] >> (k % 64) & 1) {
                code = 3, at = starts[i];
                break;
            }
            seen[k / 64] |= 1ULL << (k % 64);
        }
        free(seen);
    }
    PyBuffer_Release(&idx);
    PyBuffer_Release(&out);
    if (code < 0) return NULL;
    return Py_BuildValue("(LL)", code, at);
}

PyDoc_STRVAR(moved_doc,
             "moved(table, entries, base, offsets, gens, mask) -> int\n\n"
             "After a copy out of pool slots: how many of them were freed since their generations\n"
             "``gens`` were read, comparing the generation table (``entries`` u64s at address ``table``,\n"
             "one per 4 KiB page of the slot area at ``base``) entry of each slot (``offsets``: int64)\n"
             "with its uint64 ``gens``, after an acquire fence: every load of the copy, made before the\n"
             "call, is done before the table is read (free on x86-64, a barrier on arm64). Writes 1 into\n"
             "the uint8 ``mask`` (or None) for each moved slot (an offset outside the table counts as\n"
             "moved). Offsets may be int64 (they are never negative).");

static PyObject *py_moved(PyObject *self, PyObject *args) {
    unsigned long long table, entries, base;
    PyObject *off_obj, *gen_obj, *mask_obj;
    if (!PyArg_ParseTuple(args, "KKKOOO", &table, &entries, &base, &off_obj, &gen_obj, &mask_obj)) return NULL;
    Py_buffer offs, gens, mask;
    if (get_u64s(off_obj, &offs, "offsets") < 0) return NULL;
    if (get_u64s(gen_obj, &gens, "gens") < 0) {
        PyBuffer_Release(&offs);
        return NULL;
    }
    int has_mask = mask_obj != Py_None;
    if (has_mask && PyObject_GetBuffer(mask_obj, &mask, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&offs);
        PyBuffer_Release(&gens);
        return NULL;
    }
    Py_ssize_t n = offs.len / 8;
    long long moved = -1;
    if (gens.len != offs.len || (has_mask && mask.len < n)) {
        PyErr_SetString(PyExc_ValueError, "offsets, gens and mask must have one item per slot");
    } else {
        const uint64_t *gen_table = (const uint64_t *)(uintptr_t)table;
        const uint64_t *o = (const uint64_t *)offs.buf, *g = (const uint64_t *)gens.buf;
        uint8_t *out = has_mask ? (uint8_t *)mask.buf : NULL;
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        moved = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t page = (o[i] - base) / 4096;
            int bad = o[i] < base || page >= entries || __atomic_load_n(&gen_table[page], __ATOMIC_RELAXED) != g[i];
            if (out) out[i] = (uint8_t)bad;
            moved += bad;
        }
    }
    PyBuffer_Release(&offs);
    PyBuffer_Release(&gens);
    if (has_mask) PyBuffer_Release(&mask);
    if (moved < 0) return NULL;
    return PyLong_FromLongLong(moved);
}

static PyObject *py_copy_mode(PyObject *self, PyObject *args) {
    int pool = -1, avx2 = -1;
    if (!PyArg_ParseTuple(args, "|ii", &pool, &avx2)) return NULL;
    kvdock_copy_mode(&pool, &avx2);
    return Py_BuildValue("(OO)", pool ? Py_True : Py_False, avx2 ? Py_True : Py_False);
}

static PyMethodDef methods[] = {
    {"_copy_mode", py_copy_mode, METH_VARARGS,
     "_copy_mode(pool=-1, avx2=-1) -> (pool, avx2) as they were: whether copies on several threads\n"
     "use the kept workers (else a thread per part, started and joined per call) and AVX2 (else\n"
     "SSE2; never where the CPU lacks it); -1 leaves one as it is. For tests and A/B only."},
    {"moved", py_moved, METH_VARARGS, moved_doc},
    {"copy_grid", py_copy_grid, METH_VARARGS, copy_grid_doc},
    {"pack_tokens", py_pack_tokens, METH_O, pack_tokens_doc},
    {"blank", py_blank, METH_VARARGS, blank_doc},
    {"copy_runs", py_copy_runs, METH_VARARGS, copy_runs_doc},
    {"populate", py_populate, METH_VARARGS, populate_doc},
    {"page_starts", py_page_starts, METH_VARARGS, page_starts_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvdock._native",
                                    "Native helpers of kvdock's data plane (see kvdock.memcpy).", -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
    kvdock_copy_init();
    PyObject *mod = PyModule_Create(&module);
    if (mod && PyModule_AddIntConstant(mod, "MAX_THREADS", MAX_THREADS) < 0) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
