"""The small sweep spec the sweep and spec tests share: 3 ladder sizes x {standard, goldfish k=4}."""

import textwrap

SPEC = textwrap.dedent('''
    [sweep]
    name = "mini"
    description = "fake runs"

    [base.train]
    batch_size = 4

    [base.wandb]
    mode = "disabled"

    [axes]
    "model.name" = ["ladder-1m", "ladder-3m", "ladder-10m"]
    loss = [{ kind = "standard" }, { kind = "goldfish", k = 4 }]
''')

IDS = [f"{m}_{loss}" for m in ("ladder-1m", "ladder-3m", "ladder-10m") for loss in ("standard", "goldfish-k4")]
