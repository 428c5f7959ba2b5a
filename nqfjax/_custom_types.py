"""Shared jaxtyping aliases."""

from jaxtyping import Array, ArrayLike, Float, Int


Scalar = Float[Array, ""]
ScalarLike = Float[ArrayLike, ""]
Matrix = Float[Array, "p p"]
Vector = Float[Array, " p"]
StructureMatrix = Float[Array, "k p p"]
Weights = Float[Array, "p m"]
Times = Float[Array, " T"]
IntScalar = Int[Array, ""]
