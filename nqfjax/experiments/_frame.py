r"""The predicted weights in the frame of units that gradient descent
carries (`_gap.carried_factors`).

An engine that integrates $M = W W^\top$ gives the weights at the records as
$W(t) = M(t)^{1/2} O$ (`validity.factors_of`), the polar factor $O$ of the
initial weights held fixed. Gradient descent on the quadratic form moves the
weights by $\dot W = -2\eta\,G W$ ($G$ symmetric): from the left only, so a
direction $\psi(t) = \Phi(T, t)^\top \psi$ carried back by that flow keeps its
pattern over the units, $W(t)^\top \psi(t)$, fixed. $M^{1/2} O$ has the same
$M$ but turns the units' frame: for `Conv1D` on MNIST-1D (targets x1, init
`1e-3`) the third mode's pattern turns by 40 degrees between the first record
read and its switch-on, where gradient descent on the quadratic form keeps it
within 7 degrees. A layer whose units are not interchangeable (each unit's
own nonlinearity) feeds its waiting modes through the units that carry them,
and a feed read in a turning frame adds up across records in directions that
gradient descent never takes.

So the weights at each record are the factor of the engine's $M$ nearest
(Frobenius) to the previous record's weights carried by the quadratic form's
flow between the two, $\Phi_i W_i$, $\Phi_i = e^{-2\eta (t_{i+1} - t_i) \bar
G_i}$ (as `_shifts.carry_back`): $W_{i+1} = F_{i+1} Q$ with $F_{i+1}$ the engine's
factor and $Q$ the orthogonal Procrustes rotation of $F_{i+1}^\top \Phi_i
W_i$. $W W^\top = M$ at every record, as before; the first record is kept.
`_gap.gradient_gap` carries the frame (`nearest_factor`) inside its loop
over the records that reads the gap; `_gap.carried_factors` gives the
carried weights alone.
"""

import jax.numpy as jnp


def nearest_factor(F, Y):
    r"""The factor of $F F^\top$ nearest `Y` (Frobenius), $F Q$ with $Q$ the
    orthogonal Procrustes rotation of $F^\top Y$; `F`, `Y` of shape `(p, m)`;
    and the thin SVD's $U$, $S$ of $F = U S V^\top$ (so $F F^\top = U S^2
    U^\top$; shapes `(p, r)`, `(r,)`, $r = \min(p, m)$, $S$ descending):
    `(F Q, U, S)`. By thin SVDs only ($F Q$ depends on $Q$ only through
    $P = V^\top Q$, and the $P$ nearest is the polar factor of
    $S U^\top Y$; an `(m, m)` SVD of rank `p` is slow on its zero singular
    values)."""
    U, S, _ = jnp.linalg.svd(F, full_matrices=False)
    A, _, Bt = jnp.linalg.svd(S[:, None] * (U.T @ Y), full_matrices=False)
    return U @ (S[:, None] * (A @ Bt)), U, S
