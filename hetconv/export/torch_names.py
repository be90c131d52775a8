"""The PyTorch module names of a network's conv layers, as the safetensors export uses them.

A plain network's conv layer ``i`` is the ``Conv2d`` ``conv{i}`` with the ``BatchNorm2d``
``bn{i}``. A residual network made of a stem conv and residual blocks takes torchvision's
ResNet names, so a ResNet module written the usual way loads the file as it is: the stem
``conv1``/``bn1``; block ``b`` of stage ``s`` ``layer{s}.{b}.conv1``/``bn1``,
``.conv2``/``bn2`` and, for a projection shortcut, ``.downsample.0`` (the 1x1 conv) and
``.downsample.1`` (its batch norm). A stage starts at the first block and at every block
with a projection (the width or the stride changes). Any other residual network keeps
the plain names.
"""
from __future__ import annotations

from hetconv.model import NO_ROUTE, ModelConfig, conv_layer_shapes
from hetconv.names import layer_key


def module_names(model: ModelConfig) -> list[tuple[str, str]]:
    """(conv module, batch-norm module) per conv layer, in layer order."""
    shapes = conv_layer_shapes(model)
    # the plain module name is hetconv's own layer prefix (conv{i})
    plain = [(layer_key(i, "weight").removesuffix(".weight"), f"bn{i}")
             for i in range(len(shapes))]
    if not model.residual or shapes[0].input_from != NO_ROUTE or not shapes[0].relu:
        return plain
    names: dict[int, tuple[str, str]] = {0: ("conv1", "bn1")}
    stage, block = 0, 0
    for shape in shapes:
        if shape.shortcut_from == NO_ROUTE:
            continue
        second = shape.index
        first = shape.index - 1 if shape.input_from == NO_ROUTE else shape.input_from - 1
        projection = shape.shortcut_from - 1 if shape.shortcut_from - 1 > first else None
        if stage == 0 or projection is not None:
            stage, block = stage + 1, 0
        else:
            block += 1
        prefix = f"layer{stage}.{block}"
        names[first] = (f"{prefix}.conv1", f"{prefix}.bn1")
        names[second] = (f"{prefix}.conv2", f"{prefix}.bn2")
        if projection is not None:
            names[projection] = (f"{prefix}.downsample.0", f"{prefix}.downsample.1")
    if sorted(names) != list(range(len(shapes))):
        return plain  # a plain conv between blocks: no torchvision name for it
    return [names[i] for i in range(len(shapes))]
