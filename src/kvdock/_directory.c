/* kvdock._directory: the pool's directory of readable L1 objects, written by the server and
 * read by shared-memory clients without a round trip (kvdock.shm.directory is its Python face).
 *
 * The directory is an array of 128-byte entries in the segment, grouped in buckets of BUCKET
 * entries; a key (namespace digest, chunk hash) lives in bucket (first 8 bytes of the chunk hash
 * XOR those of the namespace) & (buckets - 1), or nowhere (its bucket was full: the server counts
 * it as unindexed). An entry whose offset is 0 is free.
 *
 * One writer (the server's event loop), any number of readers in other processes: each entry is
 * a seqlock. The writer makes the sequence odd, writes the fields, makes it even again; a reader
 * reads the sequence (acquire), the fields (relaxed atomics), an acquire fence, and the sequence
 * again: equal and even means the fields are one publication (Boehm, "Can seqlocks get along
 * with programming language memory models?", 2012). Every field is accessed as an atomic u64.
 *
 * What a reader gets is a (slot offset, slot generation) pair that was true when the entry was
 * read; the reader copies the slot and then compares the slot's generation in the generation
 * table with it (kvdock.sdk._transfer): the slot was not freed in between iff it is unchanged.
 *
 * The caller passes the directory's address in a mapping it keeps alive for the call: nothing
 * here checks it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define BUCKET 8
#define HASH_WORDS 4 /* 32-byte digests */
#define READ_TRIES 64 /* a reader gives up on an entry that keeps changing (then: a miss) */

typedef struct {
    uint64_t seq;
    uint64_t chunk[HASH_WORDS];
    uint64_t ns[HASH_WORDS];
    uint64_t offset; /* 0: free */
    uint64_t gen;
    uint64_t nbytes;
    uint64_t version;
    uint64_t parent;
    uint64_t reserved[2];
} entry_t;

_Static_assert(sizeof(entry_t) == 128, "a directory entry is 128 bytes");

typedef struct {
    uint64_t chunk[HASH_WORDS];
    uint64_t ns[HASH_WORDS];
    uint64_t offset, gen, nbytes, version, parent;
} fields_t;

#define LOAD(p) __atomic_load_n((p), __ATOMIC_RELAXED)
#define STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELAXED)

static uint64_t bucket_of(const uint64_t *ns, const uint64_t *chunk, uint64_t nbuckets) {
    return (chunk[0] ^ ns[0]) & (nbuckets - 1);
}

/* Writer side (one thread of one process). */
static void write_entry(entry_t *e, const fields_t *f) {
    uint64_t s = e->seq;
    STORE(&e->seq, s + 1);
    __atomic_thread_fence(__ATOMIC_RELEASE); /* the odd sequence is seen before any field */
    for (int i = 0; i < HASH_WORDS; i++) {
        STORE(&e->chunk[i], f->chunk[i]);
        STORE(&e->ns[i], f->ns[i]);
    }
    STORE(&e->offset, f->offset);
    STORE(&e->gen, f->gen);
    STORE(&e->nbytes, f->nbytes);
    STORE(&e->version, f->version);
    STORE(&e->parent, f->parent);
    __atomic_store_n(&e->seq, s + 2, __ATOMIC_RELEASE); /* every field is seen before it */
}

/* Reader side: 1 and the fields of one publication, or 0 if the entry kept changing. */
static int read_entry(entry_t *e, fields_t *f) {
    for (int t = 0; t < READ_TRIES; t++) {
        uint64_t s1 = __atomic_load_n(&e->seq, __ATOMIC_ACQUIRE);
        if (s1 & 1) continue;
        for (int i = 0; i < HASH_WORDS; i++) {
            f->chunk[i] = LOAD(&e->chunk[i]);
            f->ns[i] = LOAD(&e->ns[i]);
        }
        f->offset = LOAD(&e->offset);
        f->gen = LOAD(&e->gen);
        f->nbytes = LOAD(&e->nbytes);
        f->version = LOAD(&e->version);
        f->parent = LOAD(&e->parent);
        __atomic_thread_fence(__ATOMIC_ACQUIRE); /* the fields are read before the check */
        if (LOAD(&e->seq) == s1) return 1;
    }
    return 0;
}

static int get_digest(PyObject *obj, uint64_t out[HASH_WORDS], const char *what) {
    Py_buffer b;
    if (PyObject_GetBuffer(obj, &b, PyBUF_SIMPLE) < 0) return -1;
    if (b.len != 8 * HASH_WORDS) {
        PyErr_Format(PyExc_ValueError, "%s must be 32 bytes, got %zd", what, b.len);
        PyBuffer_Release(&b);
        return -1;
    }
    memcpy(out, b.buf, 8 * HASH_WORDS);
    PyBuffer_Release(&b);
    return 0;
}

static int check_buckets(unsigned long long nbuckets) {
    if (nbuckets == 0 || (nbuckets & (nbuckets - 1))) {
        PyErr_SetString(PyExc_ValueError, "the number of buckets must be a power of two");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(publish_doc,
             "publish(addr, nbuckets, items) -> list[int]\n\n"
             "Write each of ``items`` ((ns, chunk, offset, gen, nbytes, version, parent) tuples), in\n"
             "order, into a free entry of its key's bucket and return each one's entry number, or -1\n"
             "where the bucket is full. The caller is the only writer and knows no key is published\n"
             "already (nor named twice). ``offset`` must not be 0. Every item is checked before any is\n"
             "written: on an error nothing is.");

static PyObject *py_publish(PyObject *self, PyObject *args) {
    unsigned long long addr, nbuckets;
    PyObject *items, *seq, *out = NULL;
    if (!PyArg_ParseTuple(args, "KKO", &addr, &nbuckets, &items)) return NULL;
    if (check_buckets(nbuckets) < 0) return NULL;
    if (!(seq = PySequence_Fast(items, "publish takes a sequence of entries"))) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    fields_t *fs = PyMem_Malloc(sizeof(fields_t) * (size_t)(n ? n : 1));
    if (fs == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *ns_obj, *chunk_obj;
        unsigned long long offset, gen, nbytes, version, parent;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, k), "OOKKKKK", &ns_obj, &chunk_obj, &offset, &gen,
                              &nbytes, &version, &parent) ||
            get_digest(ns_obj, fs[k].ns, "ns") < 0 || get_digest(chunk_obj, fs[k].chunk, "chunk") < 0)
            goto done;
        if (offset == 0) {
            PyErr_SetString(PyExc_ValueError, "an object's offset cannot be 0");
            goto done;
        }
        fs[k].offset = offset, fs[k].gen = gen, fs[k].nbytes = nbytes, fs[k].version = version, fs[k].parent = parent;
    }
    if (!(out = PyList_New(n))) goto done;
    entry_t *entries = (entry_t *)(uintptr_t)addr;
    for (Py_ssize_t k = 0; k < n; k++) {
        long long got = -1;
        uint64_t first = bucket_of(fs[k].ns, fs[k].chunk, nbuckets) * BUCKET;
        for (uint64_t i = first; i < first + BUCKET; i++) {
            if (LOAD(&entries[i].offset) == 0) {
                write_entry(&entries[i], &fs[k]);
                got = (long long)i;
                break;
            }
        }
        PyObject *entry = PyLong_FromLongLong(got);
        if (entry == NULL) { /* (the entries stay written: out of memory, the server fails anyway) */
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, k, entry);
    }
done:
    PyMem_Free(fs);
    Py_DECREF(seq);
    return out;
}

PyDoc_STRVAR(rewrite_doc,
             "rewrite(addr, entries, entry, ns, chunk, offset, gen, nbytes, version, parent)\n\n"
             "Replace published entry number ``entry`` with another object of the same key in one\n"
             "write: a reader sees the old object or the new one, never no object (an overwrite).");

static int check_entry(unsigned long long entry, unsigned long long entries) {
    if (entry >= entries) {
        PyErr_Format(PyExc_IndexError, "entry %llu of a directory of %llu", entry, entries);
        return -1;
    }
    return 0;
}

static PyObject *py_rewrite(PyObject *self, PyObject *args) {
    unsigned long long addr, entries, entry;
    PyObject *ns_obj, *chunk_obj;
    fields_t f;
    unsigned long long offset, gen, nbytes, version, parent;
    if (!PyArg_ParseTuple(args, "KKKOOKKKKK", &addr, &entries, &entry, &ns_obj, &chunk_obj, &offset, &gen, &nbytes,
                          &version, &parent))
        return NULL;
    if (check_entry(entry, entries) < 0 || get_digest(ns_obj, f.ns, "ns") < 0 || get_digest(chunk_obj, f.chunk, "chunk") < 0)
        return NULL;
    entry_t *e = (entry_t *)(uintptr_t)addr + entry;
    if (offset == 0 || LOAD(&e->offset) == 0 || memcmp((const void *)e->chunk, f.chunk, 32) ||
        memcmp((const void *)e->ns, f.ns, 32)) {
        PyErr_SetString(PyExc_ValueError, "rewrite replaces a published entry with the same key, at a nonzero offset");
        return NULL;
    }
    f.offset = offset, f.gen = gen, f.nbytes = nbytes, f.version = version, f.parent = parent;
    write_entry(e, &f);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(unpublish_doc,
             "unpublish(addr, entries, entry)\n\n"
             "Free entry number ``entry`` (readers see no key there from now on).");

static PyObject *py_unpublish(PyObject *self, PyObject *args) {
    unsigned long long addr, entries, entry;
    if (!PyArg_ParseTuple(args, "KKK", &addr, &entries, &entry) || check_entry(entry, entries) < 0) return NULL;
    entry_t *e = (entry_t *)(uintptr_t)addr + entry;
    fields_t f;
    memset(&f, 0, sizeof f);
    write_entry(e, &f);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(read_doc,
             "read(addr, entries, entry) -> (ns, chunk, offset, gen, nbytes, version, parent) | None\n\n"
             "One entry as a reader sees it (None: free, or it kept changing).");

static PyObject *py_read(PyObject *self, PyObject *args) {
    unsigned long long addr, entries, entry;
    if (!PyArg_ParseTuple(args, "KKK", &addr, &entries, &entry) || check_entry(entry, entries) < 0) return NULL;
    fields_t f;
    if (!read_entry((entry_t *)(uintptr_t)addr + entry, &f) || f.offset == 0) Py_RETURN_NONE;
    return Py_BuildValue("(y#y#KKKKK)", (const char *)f.ns, (Py_ssize_t)32, (const char *)f.chunk, (Py_ssize_t)32,
                         (unsigned long long)f.offset, (unsigned long long)f.gen, (unsigned long long)f.nbytes,
                         (unsigned long long)f.version, (unsigned long long)f.parent);
}

enum { FOUND = 0, ABSENT = 1, UNSURE = 2, BROKEN = 3 };

/* Look key (ns, chunk) up in its bucket: FOUND (and its fields), ABSENT, or UNSURE when an entry
 * that could have been it kept changing while it was read. */
static int lookup(entry_t *entries, uint64_t nbuckets, const uint64_t *ns, const uint64_t *chunk, fields_t *out,
                  uint64_t *at) {
    uint64_t first = bucket_of(ns, chunk, nbuckets) * BUCKET;
    int unsure = 0;
    for (uint64_t i = first; i < first + BUCKET; i++) {
        if (!read_entry(&entries[i], out)) {
            unsure = 1;
            continue;
        }
        if (out->offset && !memcmp(out->chunk, chunk, 8 * HASH_WORDS) && !memcmp(out->ns, ns, 8 * HASH_WORDS)) {
            *at = i;
            return FOUND;
        }
    }
    return unsure ? UNSURE : ABSENT;
}

PyDoc_STRVAR(find_doc,
             "find(addr, nbuckets, ns, hashes, out, lo, hi, nbytes) -> (count, status)\n\n"
             "Look up the chunks of one prompt (``hashes``: their 32-byte chained hashes back to back)\n"
             "in namespace ``ns``, in order, while they are published, form one version chain (each\n"
             "one's parent is the version of the one before; 0 for the first) and name a slot of\n"
             "``nbytes`` bytes, page-aligned, within [lo, hi). Writes (entry, offset, gen) of each into\n"
             "``out`` (a writable uint64 buffer, 3 per chunk) and returns how many, and why it stopped:\n"
             "0 at the end, 1 at a chunk that is not published, 2 at one it cannot vouch for (not such\n"
             "a slot, or an entry that kept changing), 3 at one that does not chain to the one before.");

static PyObject *py_find(PyObject *self, PyObject *args) {
    unsigned long long addr, nbuckets, lo, hi, nbytes;
    PyObject *ns_obj, *hashes_obj, *out_obj;
    if (!PyArg_ParseTuple(args, "KKOOOKKK", &addr, &nbuckets, &ns_obj, &hashes_obj, &out_obj, &lo, &hi, &nbytes))
        return NULL;
    uint64_t ns[HASH_WORDS];
    if (check_buckets(nbuckets) < 0 || get_digest(ns_obj, ns, "ns") < 0) return NULL;
    Py_buffer hashes, out;
    if (PyObject_GetBuffer(hashes_obj, &hashes, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&hashes);
        return NULL;
    }
    Py_ssize_t n = hashes.len / 32;
    PyObject *result = NULL;
    if (hashes.len % 32 || out.len < n * 24) {
        PyErr_SetString(PyExc_ValueError, "hashes must be 32 bytes each, and out 24 bytes per hash");
        goto done;
    }
    entry_t *entries = (entry_t *)(uintptr_t)addr;
    uint64_t *dst = (uint64_t *)out.buf;
    uint64_t parent = 0;
    Py_ssize_t i = 0;
    int status = FOUND;
    for (; i < n; i++) {
        uint64_t chunk[HASH_WORDS];
        memcpy(chunk, (const char *)hashes.buf + 32 * i, 32);
        fields_t f;
        uint64_t at = 0;
        status = lookup(entries, nbuckets, ns, chunk, &f, &at);
        if (status != FOUND) break;
        if (f.nbytes != nbytes || f.offset < lo || f.offset > hi || hi - f.offset < nbytes || f.offset % 4096) {
            status = UNSURE;
            break;
        }
        if (f.parent != parent) {
            status = BROKEN;
            break;
        }
        dst[3 * i] = at;
        dst[3 * i + 1] = f.offset;
        dst[3 * i + 2] = f.gen;
        parent = f.version;
    }
    result = Py_BuildValue("(ni)", i, status);
done:
    PyBuffer_Release(&hashes);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"publish", py_publish, METH_VARARGS, publish_doc},
    {"rewrite", py_rewrite, METH_VARARGS, rewrite_doc},
    {"unpublish", py_unpublish, METH_VARARGS, unpublish_doc},
    {"read", py_read, METH_VARARGS, read_doc},
    {"find", py_find, METH_VARARGS, find_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvdock._directory",
                                    "The pool directory's seqlocked entries (see kvdock.shm.directory).", -1, methods};

PyMODINIT_FUNC PyInit__directory(void) {
    PyObject *mod = PyModule_Create(&module);
    if (mod && (PyModule_AddIntConstant(mod, "BUCKET", BUCKET) < 0 ||
                PyModule_AddIntConstant(mod, "ENTRY_SIZE", (long)sizeof(entry_t)) < 0)) {
        Py_DECREF(mod);
        return NULL;
    }
    return mod;
}
