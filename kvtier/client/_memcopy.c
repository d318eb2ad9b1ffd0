/* kvtier.client._memcopy: one bulk copy between two buffers, with non-temporal stores where they pay.
 *
 * Why this exists: a block payload copied into shared memory (a save) or out of it (a load) is
 * megabytes that the copying CPU will not read again soon. An ordinary store first reads every
 * destination cache line (read-for-ownership) and then leaves the payload in the cache, pushing
 * out what the process does touch next (the client's and the daemon's own code and data). glibc's
 * memcpy switches to non-temporal stores only above x86_non_temporal_threshold, which it derives
 * from the cache size the CPU reports; virtual machines often report the host socket's whole L3
 * (64 MiB on the development VM: threshold 48 MiB), so 2-32 MiB blocks never get them. Measured on
 * that VM, 2-32 MiB copies over a 256 MiB working set, one thread: 5.6-6.8 GB/s with memcpy or
 * torch copy_, 8.8-10.9 GB/s with this (`kvtier bench dataplane` reports both).
 *
 * copy(dst, src): dst a writable C-contiguous buffer, src a C-contiguous buffer of the same byte
 * length (overlap allowed: then memmove). Copies of at least NONTEMPORAL_MIN_BYTES use streaming
 * stores (x86-64: SSE2, which every x86-64 has) and release the GIL while they run; smaller ones
 * are a plain memcpy under the GIL, where releasing it would cost more than the copy.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define KVTIER_HAVE_NT 1
#else
#define KVTIER_HAVE_NT 0
#endif

/* Below this a copy stays in the cache anyway (L2 is 512 KiB and up on current server parts), and
 * the caller is likely to touch the bytes again; above it, streaming avoids the read-for-ownership
 * and the eviction of everything else. */
#define NONTEMPORAL_MIN_BYTES ((Py_ssize_t)256 * 1024)

#if KVTIER_HAVE_NT
/* Streaming copies go forward, except when the destination lies a little ahead of the source
 * modulo 4 KiB: 0 < (dst - src) mod 4096 < ALIAS_WINDOW. There each load of a forward loop reads
 * an address whose low 12 bits equal those of a store it has just issued; the CPU cannot tell the
 * two apart until the store drains ("4K aliasing"), and the load waits. A backward loop turns that
 * round (the aliasing stores are ones not yet issued) and suffers the mirror case instead, a
 * destination a little behind the source, which the forward loop does not.
 *
 * Measured on the development VM (AMD EPYC, 2 MiB copies over 128 MiB, distances swept in steps
 * of 16 and 32 bytes): forward 7.2-7.9 GB/s at dst - src = 16..96 (mod 4096), backward 7.3-8.0 at
 * -96..-16, and 10.4-11.3 everywhere with the choice below. Which distance a copy gets is chance
 * (where a block's header ends, where malloc or an allocator put the engine's tensor): before this
 * choice, loads out of shared memory ran ~20 % slower than copies between private buffers only
 * because their distances fell in the window more often. A wider window (deeper store buffers)
 * would cost a few per cent at 128-255, where backward ran ~6 % slower than forward here. */
#define ALIAS_WINDOW 128u

/* How far ahead, in the direction of travel, the source is prefetched (non-temporal hint: it is
 * read once; a prefetch outside the buffer never faults). Backward loops ran 9.7-10.1 GB/s with
 * 1 KiB and 10.9-11.2 with 512 bytes (hardware prefetchers follow descending streams less
 * eagerly); forward ones the same with either. */
#define PREFETCH_BYTES 512

/* One whole 64-byte line: four unaligned 16-byte loads, four aligned streaming stores. Whole
 * lines, because a write-combining buffer flushed with part of a line costs several bus
 * transactions. */
static inline void stream_line(char *dst, const char *src) {
    __m128i a = _mm_loadu_si128((const __m128i *)(src));
    __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
    __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
    _mm_stream_si128((__m128i *)(dst), a);
    _mm_stream_si128((__m128i *)(dst + 16), b);
    _mm_stream_si128((__m128i *)(dst + 32), c);
    _mm_stream_si128((__m128i *)(dst + 48), d);
}

/* The destination's unaligned head and tail are copied plainly and the whole lines between them
 * stream, forward or backward (ALIAS_WINDOW). The sfence orders the streaming stores before
 * anything the caller does next (e.g. a commit naming these bytes).
 *
 * Measured on the development VM (AMD EPYC with AVX2), 2 MiB copies: a 32-byte AVX loop unrolled
 * to 128 bytes ran 7.2-8.1 GB/s against this loop's 8.2-9.0 whatever the source's offset within a
 * cache line, and `kvtier bench dataplane`'s memcpy rows fell from 9.7-10.9 to 8.8-9.3 GB/s with
 * it. So SSE2 only, which every x86-64 has. */
static void copy_nontemporal(char *dst, const char *src, size_t n) {
    size_t head = (size_t)(-(uintptr_t)dst & 63u);
    size_t tail = (size_t)((uintptr_t)(dst + n) & 63u);
    size_t end = n - tail; /* dst + head and dst + end are line-aligned; n >= 128 keeps head <= end */
    size_t distance = (size_t)((uintptr_t)dst - (uintptr_t)src) & 4095u;
    if (distance != 0 && distance < ALIAS_WINDOW) {
        memcpy(dst + end, src + end, tail);
        for (size_t i = end; i > head;) {
            i -= 64;
            _mm_prefetch(src + i - PREFETCH_BYTES, _MM_HINT_NTA);
            stream_line(dst + i, src + i);
        }
        _mm_sfence();
        memcpy(dst, src, head);
    } else {
        memcpy(dst, src, head);
        for (size_t i = head; i < end; i += 64) {
            _mm_prefetch(src + i + PREFETCH_BYTES, _MM_HINT_NTA);
            stream_line(dst + i, src + i);
        }
        _mm_sfence();
        memcpy(dst + end, src + end, tail);
    }
}
#endif

static int overlaps(const char *a, const char *b, size_t n) {
    return (a < b + n) && (b < a + n);
}

/* One copy of `n` bytes between two held buffers, by size and overlap (see the file comment);
 * `streaming` 0: the C library's memcpy whatever the size (the benchmarks' reference). */
static void copy_one(char *d, const char *s, size_t n, int streaming) {
    if (overlaps(d, s, n)) {
        memmove(d, s, n);
#if KVTIER_HAVE_NT
    } else if (streaming && n >= (size_t)NONTEMPORAL_MIN_BYTES) {
        copy_nontemporal(d, s, n);
#endif
    } else {
        memcpy(d, s, n);
    }
}

/* Export dst (writable) and src into the two Py_buffers, of equal byte lengths; on failure
 * nothing stays exported and an exception is set. `what` names the pair in messages. */
static int get_pair(PyObject *dst_obj, PyObject *src_obj, Py_buffer *dst, Py_buffer *src, const char *what) {
    if (PyObject_GetBuffer(dst_obj, dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        return -1;
    }
    if (PyObject_GetBuffer(src_obj, src, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(dst);
        return -1;
    }
    if (dst->len != src->len) {
        PyErr_Format(PyExc_ValueError, "%s: destination holds %zd bytes, source %zd", what, dst->len, src->len);
        PyBuffer_Release(src);
        PyBuffer_Release(dst);
        return -1;
    }
    return 0;
}

static void copy_all(const Py_buffer *pairs, Py_ssize_t count, int streaming) {
    for (Py_ssize_t i = 0; i < count; i++) {
        copy_one((char *)pairs[2 * i].buf, (const char *)pairs[2 * i + 1].buf, (size_t)pairs[2 * i].len,
                 streaming);
    }
}

/* copy_one of each exported pair (pairs[2i] the destination, pairs[2i + 1] its source), without the
 * GIL when any of them is at least NONTEMPORAL_MIN_BYTES: the buffers stay exported meanwhile, so
 * none can be resized or freed under the copy. Smaller copies keep the GIL: releasing it would cost
 * more. (Without streaming stores the large ones release it too, so that the memcpy reference of
 * the benchmarks runs on several threads exactly as the streaming copy does.) */
static void copy_pairs(const Py_buffer *pairs, Py_ssize_t count, int streaming) {
    int large = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        large |= pairs[2 * i].len >= NONTEMPORAL_MIN_BYTES;
    }
    if (large && (KVTIER_HAVE_NT || !streaming)) {
        Py_BEGIN_ALLOW_THREADS
        copy_all(pairs, count, streaming);
        Py_END_ALLOW_THREADS
    } else {
        copy_all(pairs, count, streaming);
    }
}

static PyObject *memcopy_copy(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "copy(dst, src) takes 2 arguments, got %zd", nargs);
        return NULL;
    }
    Py_buffer pair[2];
    if (get_pair(args[0], args[1], &pair[0], &pair[1], "copy") < 0) {
        return NULL;
    }
    copy_pairs(pair, 1, 1);
    PyBuffer_Release(&pair[1]);
    PyBuffer_Release(&pair[0]);
    Py_RETURN_NONE;
}

/* copy_many(dsts, srcs): every pair exported and checked first (an error copies nothing), then
 * all copies back to back, the GIL released once for them all when any is large. One call per
 * batch of blocks instead of one per block: between two multi-MiB copies the interpreter runs on
 * caches the previous copy has just emptied, and each block's Python (views, checks, call) costs
 * ~3x what it costs warm. */
static PyObject *memcopy_copy_many(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2 && nargs != 3) {
        PyErr_Format(PyExc_TypeError, "copy_many(dsts, srcs, streaming=True) takes 2 or 3 arguments, got %zd",
                     nargs);
        return NULL;
    }
    int streaming = nargs == 3 ? PyObject_IsTrue(args[2]) : 1;
    if (streaming < 0) {
        return NULL;
    }
    PyObject *dsts = PySequence_Fast(args[0], "copy_many: dsts must be a sequence of buffers");
    if (dsts == NULL) {
        return NULL;
    }
    PyObject *srcs = PySequence_Fast(args[1], "copy_many: srcs must be a sequence of buffers");
    if (srcs == NULL) {
        Py_DECREF(dsts);
        return NULL;
    }
    PyObject *result = NULL;
    Py_buffer *bufs = NULL;
    Py_ssize_t held = 0;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(dsts);
    if (PySequence_Fast_GET_SIZE(srcs) != count) {
        PyErr_Format(PyExc_ValueError, "copy_many: %zd destinations, %zd sources", count,
                     PySequence_Fast_GET_SIZE(srcs));
        goto done;
    }
    bufs = PyMem_Calloc((size_t)count * 2 + 1, sizeof(Py_buffer));
    if (bufs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; held < count; held++) {
        Py_buffer *pair = bufs + 2 * held;
        if (get_pair(PySequence_Fast_GET_ITEM(dsts, held), PySequence_Fast_GET_ITEM(srcs, held), pair, pair + 1,
                     "copy_many") < 0) {
            goto done;
        }
    }
    copy_pairs(bufs, count, streaming);
    result = Py_NewRef(Py_None);
done:
    for (Py_ssize_t i = 0; i < held; i++) {
        PyBuffer_Release(bufs + 2 * i + 1);
        PyBuffer_Release(bufs + 2 * i);
    }
    PyMem_Free(bufs);
    Py_DECREF(srcs);
    Py_DECREF(dsts);
    return result;
}

static PyMethodDef memcopy_methods[] = {
    {"copy", (PyCFunction)(void (*)(void))memcopy_copy, METH_FASTCALL,
     "copy(dst, src, /)\n--\n\n"
     "Copy the bytes of src into dst (both C-contiguous, dst writable, equal byte lengths).\n"
     "Non-temporal stores, GIL released, from NONTEMPORAL_MIN_BYTES where NONTEMPORAL is True."},
    {"copy_many", (PyCFunction)(void (*)(void))memcopy_copy_many, METH_FASTCALL,
     "copy_many(dsts, srcs, streaming=True, /)\n--\n\n"
     "copy(dsts[i], srcs[i]) for every i, in one call: every pair is checked before any byte is\n"
     "copied, and the GIL is released once for all of them. streaming false: the C library's\n"
     "memcpy for every size (the benchmarks' reference), the GIL released all the same."},
    {NULL, NULL, 0, NULL},
};

static int memcopy_exec(PyObject *module) {
    if (PyModule_AddIntConstant(module, "NONTEMPORAL", KVTIER_HAVE_NT) < 0) {
        return -1;
    }
    return PyModule_AddIntConstant(module, "NONTEMPORAL_MIN_BYTES", (long)NONTEMPORAL_MIN_BYTES);
}

static PyModuleDef_Slot memcopy_slots[] = {
    {Py_mod_exec, memcopy_exec},
    {0, NULL},
};

static struct PyModuleDef memcopy_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvtier.client._memcopy",
    .m_doc = "Bulk copies between buffers with non-temporal stores (see kvtier.client.memcopy).",
    .m_size = 0,
    .m_methods = memcopy_methods,
    .m_slots = memcopy_slots,
};

PyMODINIT_FUNC PyInit__memcopy(void) {
    return PyModuleDef_Init(&memcopy_module);
}
