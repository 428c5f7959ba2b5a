"""The one table from optimizer words to optax objects.

`OPTIMIZERS` maps the words a sweep configuration uses (`[grid] optimizer = [...]`)
to optax factories `learning_rate -> GradientTransformation`; `None` is plain
gradient descent (`optax.sgd`, minibatch SGD with a batch size). It is re-exported
as `nqfjax.experiments.sweep_config.OPTIMIZERS` (the command line's table), and
`Method` resolves its deprecated optimizer strings through it, so there is one
vocabulary.
"""

import dataclasses

import optax

from ..engines.clock import check_momentum


@dataclasses.dataclass(frozen=True)
class HeavyBall:
    """Heavy-ball momentum as an optax factory that knows its momentum:
    `HeavyBall(mu)(learning_rate)` is `optax.sgd(learning_rate, momentum=mu)`.

    A frozen dataclass, so two equal momenta compare and hash equal (`train`
    compiles once per optimizer factory) and `Method` can read the momentum its
    clock needs (`clock(..., momentum=mu)`).

    **Arguments:**

    - `momentum`: `mu` in `[0, 1)` (default 0.9).
    """

    momentum: float = 0.9

    def __post_init__(self):
        object.__setattr__(self, "momentum", check_momentum(self.momentum))

    def __call__(self, learning_rate) -> optax.GradientTransformation:
        return optax.sgd(learning_rate, momentum=self.momentum)


#: Optimizer words -> factory `learning_rate -> optax.GradientTransformation`
#: (`None`: plain gradient descent, `optax.sgd`; minibatch SGD with a batch size).
OPTIMIZERS = {
    "gd": None,
    "momentum": HeavyBall(0.9),
    "adam": optax.adam,
}

#: Older words accepted (deprecated) by `Method(optimizer=...)`: word -> table word.
ALIASES = {"sgd": "gd"}


def optimizer_word(optimizer) -> str | None:
    """The table's word for `optimizer` (a heavy ball of any momentum is
    `"momentum"`), or `None` when it is not in the table."""
    if isinstance(optimizer, HeavyBall):
        return "momentum"
    for word, value in OPTIMIZERS.items():
        if value is optimizer:
            return word
    return None
