/* kvpool._block_hash: the loops of kvpool.block_hash (chain_hashes, hash_rows) over OpenSSL's SHA-256, the GIL
 * released while a long run hashes. The encoding is defined once, in block_hash.py's docstring; this file only
 * concatenates the pieces that module hands it, in the order it names:
 *
 *     digest = sha256( prefix || parent || header || block_tokens )
 *
 *   chain(prefix, parent, data, block_bytes, header_public, num_public, header) -> list[bytes]
 *       the digests of data's whole blocks of block_bytes each, chained from parent: block i's parent is block
 *       i - 1's digest; the first num_public blocks with header_public, the rest with header
 *   many_flat(prefix, parents, headers, data, block_bytes) -> list[bytes]
 *       one digest for each (parent, header, block) of two equally long lists of bytes and the blocks of data,
 *       block i being bytes [i * block_bytes, (i + 1) * block_bytes) of it (any contiguous buffer of exactly
 *       len(parents) blocks): no bytes object a block
 *
 * The bytes hashed are the same as block_hash.py's loops hash (tests/core/test_chain_hashes.py compares
 * both on random input); block_hash.py uses this module when it is built, its own loops otherwise.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <openssl/sha.h>
#include <string.h>

#define DIGEST 32
#define RELEASE_GIL_BYTES 8192 /* below this (~20 us of hashing), releasing the GIL costs more than it frees */

/* SHA256_Init/Update/Final: OpenSSL 3 marks them deprecated in favour of EVP, whose per-digest provider lookups
 * cost more than a 130-byte block's hashing; they remain part of its API. */
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

static void digest4(const unsigned char *a, size_t na, const unsigned char *b, size_t nb,
                    const unsigned char *c, size_t nc, const unsigned char *d, size_t nd, unsigned char *out) {
    SHA256_CTX ctx;
    SHA256_Init(&ctx);
    SHA256_Update(&ctx, a, na);
    SHA256_Update(&ctx, b, nb);
    SHA256_Update(&ctx, c, nc);
    SHA256_Update(&ctx, d, nd);
    SHA256_Final(out, &ctx);
}

static PyObject *digests_to_list(const unsigned char *out, Py_ssize_t n) {
    PyObject *list = PyList_New(n);
    if (list == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyBytes_FromStringAndSize((const char *)out + i * DIGEST, DIGEST);
        if (item == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, item);
    }
    return list;
}

static PyObject *chain(PyObject *self, PyObject *args) {
    Py_buffer prefix, parent, data, hpub, head;
    Py_ssize_t block_bytes, num_public;
    PyObject *result = NULL;
    if (!PyArg_ParseTuple(args, "y*y*y*ny*ny*", &prefix, &parent, &data, &block_bytes, &hpub, &num_public, &head))
        return NULL;
    if (parent.len != DIGEST || block_bytes <= 0 || num_public < 0) {
        PyErr_SetString(PyExc_ValueError, "chain: parent must be 32 bytes, block_bytes > 0, num_public >= 0");
        goto done;
    }
    Py_ssize_t n = data.len / block_bytes;
    unsigned char *out = PyMem_Malloc(n ? (size_t)n * DIGEST : 1);
    if (out == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const unsigned char *p = prefix.buf, *tokens = data.buf;
    int release = data.len >= RELEASE_GIL_BYTES;
    PyThreadState *state = release ? PyEval_SaveThread() : NULL;
    const unsigned char *prev = parent.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        const Py_buffer *h = i < num_public ? &hpub : &head;
        digest4(p, prefix.len, prev, DIGEST, h->buf, h->len, tokens + i * block_bytes, block_bytes, out + i * DIGEST);
        prev = out + i * DIGEST;
    }
    if (release) PyEval_RestoreThread(state);
    result = digests_to_list(out, n);
    PyMem_Free(out);
done:
    PyBuffer_Release(&prefix);
    PyBuffer_Release(&parent);
    PyBuffer_Release(&data);
    PyBuffer_Release(&hpub);
    PyBuffer_Release(&head);
    return result;
}

static PyObject *many_flat(PyObject *self, PyObject *args) {
    Py_buffer prefix, data;
    Py_ssize_t block_bytes;
    PyObject *parents, *headers, *result = NULL;
    if (!PyArg_ParseTuple(args, "y*OOy*n", &prefix, &parents, &headers, &data, &block_bytes)) return NULL;
    PyObject *ps = PySequence_Fast(parents, "many_flat: parents must be a sequence");
    PyObject *hs = ps ? PySequence_Fast(headers, "many_flat: headers must be a sequence") : NULL;
    if (hs == NULL) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(ps);
    if (PySequence_Fast_GET_SIZE(hs) != n || block_bytes <= 0 || data.len % block_bytes || data.len / block_bytes != n) {
        PyErr_SetString(PyExc_ValueError,
                        "many_flat: parents and headers equally long, block_bytes > 0, data len(parents) blocks");
        goto done;
    }
    result = PyList_New(n);
    if (result == NULL) goto done;
    const unsigned char *tokens = data.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *p = PySequence_Fast_GET_ITEM(ps, i), *h = PySequence_Fast_GET_ITEM(hs, i);
        if (!PyBytes_Check(p) || !PyBytes_Check(h)) {
            PyErr_SetString(PyExc_TypeError, "many_flat: every parent and header must be bytes");
            Py_CLEAR(result);
            goto done;
        }
        PyObject *item = PyBytes_FromStringAndSize(NULL, DIGEST);
        if (item == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        digest4(prefix.buf, prefix.len, (const unsigned char *)PyBytes_AS_STRING(p), PyBytes_GET_SIZE(p),
                (const unsigned char *)PyBytes_AS_STRING(h), PyBytes_GET_SIZE(h), tokens + i * block_bytes,
                block_bytes, (unsigned char *)PyBytes_AS_STRING(item));
        PyList_SET_ITEM(result, i, item);
    }
done:
    Py_XDECREF(ps);
    Py_XDECREF(hs);
    PyBuffer_Release(&prefix);
    PyBuffer_Release(&data);
    return result;
}

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS, "chain(prefix, parent, data, block_bytes, header_public, num_public, header)"},
    {"many_flat", many_flat, METH_VARARGS, "many_flat(prefix, parents, headers, data, block_bytes)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_block_hash", NULL, -1, methods};

PyMODINIT_FUNC PyInit__block_hash(void) { return PyModule_Create(&module); }
