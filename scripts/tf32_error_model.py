"""Why the 3xTF32 forward's error is a few times float32's, and what would bring it to float32's: a NumPy model.

    python scripts/tf32_error_model.py

3xTF32 splits each float32 operand x into big = tf32(x) and small = tf32(x - big) (``cvt.rna.tf32.f32``: 10
mantissa bits, to nearest, ties away) and forms A B as A_small B_big + A_big B_small + A_big B_big. The split alone
loses little: each product of TF32 values is exact, and with the products summed exactly the attention's error is
below float32's (the row "3xTF32, exact sums"). The tensor cores do not sum exactly: an ``mma`` aligns its products
and the accumulator C to the largest of them and truncates, with no guard bits, and truncates the sum to float32
(Fasi, Higham, Mikaitis and Pranesh, "Numerical behavior of NVIDIA tensor cores", PeerJ CS 2021). The kernel chains
its three ``mma`` of each k-step into the running accumulator, so every step truncates (toward zero: the errors
add up rather than cancel) relative to the accumulator's whole size. Modelled so, the error comes out at a few
times float32's (the row "3xTF32 as the kernel"), of the size measured on the GPU. Chaining a k-step's three
``mma`` from zero and adding their result to the accumulator with a float32 add (rounded to nearest) confines the
truncation to the k-step's own size: the model then gives about float32's error or less. (Figures:
docs/benchmarks.md.)

The model: q, k, v standard normal (n, d) float32, one head, no mask; S = q k^T / sqrt(d), softmax in float32,
O = P v; each matrix product k-step by k-step of 8 (m16n8k8), as the kernel forms them; max |O - O_float64| over
three draws (median), beside NumPy's float32 (sgemm) attention.
"""

import numpy as np


def tf32(x):
    """float32 -> TF32 (10 mantissa bits), to nearest, ties away from zero (``cvt.rna.tf32.f32``), as float32."""
    b = np.asarray(x, np.float32).view(np.uint32)
    return ((b + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def split(x):
    x = np.asarray(x, np.float32)
    big = tf32(x)
    return big, tf32((x - big).astype(np.float32))


def _truncate(x, e):
    """x to a multiple of 2^(e - 23), toward zero."""
    u = np.exp2(e - 23.0)
    return np.trunc(x / u) * u


def _exponent(x):
    return np.floor(np.log2(np.where(x != 0, np.abs(x), 1.0)))


def mma(c, a, b):
    """One m16n8k8 ``mma`` as modelled: the k products (exact) and c aligned to the largest and truncated, the sum
    truncated to float32. c: float64 array holding float32 values; a (M, 8), b (8, N)."""
    terms = [c] + [np.outer(a[:, i], b[i]) for i in range(a.shape[1])]
    e = _exponent(np.max([np.abs(t) for t in terms], axis=0))
    s = sum(_truncate(t, e) for t in terms)
    return _truncate(s, _exponent(s))


def matmul(A, B, how):
    """A @ B in float32 by one of: "float32" (NumPy), "3xtf32 exact" (the split, products summed exactly a k-step
    at a time), "3xtf32 chained" (the kernel's: three mma a k-step into the accumulator), "3xtf32 rounded add" (a
    k-step's three mma from zero, added to the accumulator with a float32 add)."""
    if how == "float32":
        return A.astype(np.float32) @ B.astype(np.float32)
    (Ab, As), (Bb, Bs) = split(A), split(B)
    pairs = [(As, Bb), (Ab, Bs), (Ab, Bb)]  # smallest first, as the kernel
    acc = np.zeros((A.shape[0], B.shape[1]), np.float64)
    for k0 in range(0, A.shape[1], 8):
        step = [(a[:, k0:k0 + 8].astype(np.float64), b[k0:k0 + 8].astype(np.float64)) for a, b in pairs]
        if how == "3xtf32 exact":
            acc = (acc + sum(a @ b for a, b in step)).astype(np.float32).astype(np.float64)
        elif how == "3xtf32 chained":
            for a, b in step:
                acc = mma(acc, a, b)
        elif how == "3xtf32 rounded add":
            r = np.zeros_like(acc)
            for a, b in step:
                r = mma(r, a, b)
            acc = (acc + r).astype(np.float32).astype(np.float64)
        else:
            raise ValueError(how)
    return acc.astype(np.float32)


def attention(q, k, v, how):
    s = matmul(q, k.T, how) * np.float32(1 / np.sqrt(q.shape[1]))
    p = np.exp(s - s.max(1, keepdims=True)).astype(np.float32)
    return (matmul(p, v, how) / p.sum(1, keepdims=True, dtype=np.float32)).astype(np.float32)


def truth(q, k, v):
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    s = q @ k.T / np.sqrt(q.shape[1])
    p = np.exp(s - s.max(1, keepdims=True))
    return (p @ v) / p.sum(1, keepdims=True)


def main():
    rng = np.random.default_rng(0)
    rows = (("float32 (NumPy)", "float32"), ("3xTF32, exact sums", "3xtf32 exact"),
            ("3xTF32 as the kernel", "3xtf32 chained"), ("3xTF32, a k-step from zero + a rounded add",
                                                          "3xtf32 rounded add"))
    print("max |O - O_float64| (median of 3 draws), and its ratio to float32's")
    for n, d in ((97, 64), (300, 64), (256, 128)):
        errs = {name: [] for name, _ in rows}
        for _ in range(3):
            q, k, v = (rng.standard_normal((n, d)).astype(np.float32) for _ in range(3))
            t = truth(q, k, v)
            for name, how in rows:
                errs[name].append(np.abs(attention(q, k, v, how) - t).max())
        base = np.median(errs["float32 (NumPy)"])
        print(f"n={n}, d={d}:")
        for name, e in errs.items():
            print(f"  {name:44s} {np.median(e):.2e}  ({np.median(e) / base:.1f}x)")


if __name__ == "__main__":
    main()
