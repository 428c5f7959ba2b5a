r"""The learned modes' levels where the real layer holds them (`validity`).

The quadratic form holds a learned mode where its own gradient vanishes; the
real layer holds it elsewhere (a softmax head whose teacher's logits are of
order one needs about twice the weights of its linearisation). A mode still
waiting grows on the residual the learned modes leave, so the feed it gets is
read with the learned modes at the levels where the real layer holds them.

At a record where the `L` largest modes of $M = W W^\top$ are learned (by
rank; $u_a$, $\lambda_a$ its eigenvectors and eigenvalues, $v_a = W^\top
u_a$), moving the level of mode $a$ by $s_a$,

$$W(s) = W + \tfrac12 \sum_{a < L} s_a\, u_a v_a^\top / \lambda_a$$

(so $M$ moves by $\sum_a s_a u_a u_a^\top$ to first order), the levels solve

$$F^{\rm real}(s) = F^{\rm quad}(0), \qquad
F_a(s) = \frac{\partial L}{\partial s_a}
= \frac{u_a^\top \nabla_W L\, v_a}{2 \lambda_a}:$$

the real layer's drive on each learned level equals the quadratic form's at
the predicted weights (zero on a plateau; during a switch-on the quadratic
form's own pace is kept). Newton's method solves it on the quadratic form's
curvature of the levels: its drive is $(1 + s_a / 2\lambda_a)\,
u_a^\top G(s)\, u_a$, so $\partial F_a / \partial s_b = H_{ab} +
\delta_{ab}\, u_a^\top G u_a / 2\lambda_a$ with
$H_{ab} = \frac1n \sum_x \sum_j \mathrm{Tr}[A_j(x) u_a u_a^\top]\,
\mathrm{Tr}[A_j(x) u_b u_b^\top]$ (`mode_gram`; the second part, the
mode's own drive over its level, is all of it while a learned mode still
grows), in steps of one forward and backward pass of the real layer each
(`settle`), none moving a level by more than `TRUST` of it. Along a
trajectory (`_gap.gradient_gap`) each record takes one step: the gap at a
record is read at the levels that the record before's step reached, and
the record's own step is taken for the next, the levels one record behind.
At one record of a softmax head (the tests' case: learned levels 1.2 and
0.8 of $M$, its teacher's 2.0 and 1.4) each step cuts the distance to the
levels where the real layer holds them by 0.4 (the real layer's curvature
of the levels is steeper than its quadratic form's): one step from the
record before's levels is enough where they move little from record to
record. Over the 44 rows of `benchmarks/validity_calibration.py`, against
the gap read at each record's own step (a second pass a record) the
shifts moved by a median of 0.01 points and at most 2.1;
with every record of the predictions read, the two agree within 0.7 points
(2026-12-06).
"""

import jax
import jax.numpy as jnp


#: No Newton step moves a level by more than this fraction of the mode's own
#: level (a trust region: the levels' linearisation $M(s) \approx M + \sum_a
#: s_a u_a u_a^\top$ holds for $|s_a| \ll \lambda_a$, and where the curvature
#: of the levels vanishes the step is not determined).
TRUST = 0.5


def real_output_and_gradient(structure, xs, ys, W):
    r"""The real layer's outputs $f(x; W)$ on `xs` (shape `(n, k)`) and
    $\nabla_W$ of $\frac{1}{2n}\sum_x |f(x; W) - y|^2$ (shape `(p, m)`): one
    forward and backward pass."""
    f, pull = jax.vjp(lambda W: jax.vmap(lambda x: structure.layer(W, x))(xs), W)
    return f, pull((f - ys) / xs.shape[0])[0]


def real_gradient(structure, xs, ys, W):
    r"""$\nabla_W$ of $\frac{1}{2n}\sum_x |f(x; W) - y|^2$ for the real layer,
    shape `(p, m)` (`real_output_and_gradient`)."""
    return real_output_and_gradient(structure, xs, ys, W)[1]


def level_curvature(structure, xs, lam, U, drive):
    r"""The quadratic form's $\partial F_a / \partial s_b$ at $s = 0$, shape
    `(c, c)`, from the levels' drive $F_a = u_a^\top G u_a$ at `W` (`drive`,
    shape `(c,)`; `lam`, `U` as `settle`'s): $F_a(s) = (1 + s_a / 2\lambda_a)
    u_a^\top G(s) u_a$, so $H_{ab} + \delta_{ab} F_a / 2\lambda_a$ (`mode_gram`
    over the inputs `xs`). The second part, the mode's own drive over its
    level, is all of it while a learned mode still grows (digits at init
    `1e-6`, right after the first switch-on: -356 against $H = 1.8$; the
    real layer's by finite differences, -356)."""
    H = structure.mode_gram(xs, U) / xs.shape[0]
    return H + jnp.diag(drive / (2.0 * lam))


def level_weights(W, lam, U, s):
    r"""$W(s) = W + \frac12 \sum_a s_a u_a v_a^\top / \lambda_a$ (see the
    module; `lam`, `U` as `settle`'s, `lam` floored at the smallest normal
    number): `W` itself at $s = 0$."""
    lam = jnp.maximum(lam, jnp.finfo(W.dtype).tiny)
    return W + 0.5 * ((U * (s / lam)[None, :]) @ U.T) @ W


def settle(structure, xs, ys, W, g_quad, lam, U, learned, s0, g0=None):
    r"""The real layer's loss gradient at the levels `s0` of the learned modes
    (shape `(c,)`; zero past `learned`), and the levels one Newton step on
    toward where the real layer holds them (see the module): `(g, s)`,
    shapes `(p, m)` and `(c,)`. One forward and backward pass of the real
    layer at $W(s_0)$, unless `g0` gives it.

    `g_quad` the quadratic form's gradient at `W`; `lam`, `U` the eigenvalues
    (descending) and eigenvectors of $W W^\top$ of the `c` largest modes
    (shapes `(c,)`, `(p, c)`); `learned` (traced; 0: nothing moves) how many
    of them are learned.
    """
    c = lam.shape[0]
    mask = (jnp.arange(c) < learned).astype(W.dtype)
    lam = jnp.maximum(lam, jnp.finfo(W.dtype).tiny)
    V = W.T @ U  # (m, c)

    def force(g):
        return 0.5 * jnp.einsum("pa,pm,ma->a", U, g, V) / lam * mask

    target = force(g_quad)
    J = level_curvature(structure, xs, lam, U, target)
    J = J * mask[:, None] * mask[None, :] + jnp.diag(1.0 - mask)
    s0 = s0 * mask
    if g0 is None:
        g0 = real_gradient(structure, xs, ys, level_weights(W, lam, U, s0))
    # a trust region: no step moves a level by more than TRUST of it
    ds = -jnp.linalg.solve(J, force(g0) - target) * mask
    return g0, s0 + jnp.clip(ds, -TRUST * lam, TRUST * lam)
