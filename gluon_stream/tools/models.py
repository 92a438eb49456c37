"""The small Gluon model the demo and the bench train (a stand-in for a real network)."""
from __future__ import annotations

from typing import Any, Callable

from .._mx import import_mxnet

__all__ = ["small_regressor"]


def small_regressor(optimizer: str = "adam", learning_rate: float = 1e-3,
                    lstm_hidden: int | None = None) -> Callable[[Any, Any], Any]:
    """A small Gluon regressor (an MLP, or an LSTM over the windows' time steps);
    returns ``train_step(data, label) -> loss`` (one update)."""
    mx = import_mxnet()
    autograd, gluon = mx.autograd, mx.gluon

    net = gluon.nn.HybridSequential()
    if lstm_hidden:
        net.add(gluon.rnn.LSTM(lstm_hidden, layout="NTC"), gluon.nn.Dense(1))
    else:
        net.add(gluon.nn.Dense(64, activation="relu"), gluon.nn.Dense(1))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    trainer = gluon.Trainer(net.collect_params(), optimizer, {"learning_rate": learning_rate})
    loss_fn = gluon.loss.L2Loss()

    def train_step(data: Any, label: Any) -> Any:
        with autograd.record():
            loss = loss_fn(net(data), label)
        loss.backward()
        trainer.step(data.shape[0])
        return loss
    return train_step
