"""Layer ops as pure functions with forward and backward (numpy or cupy, any float dtype).

Shapes: images (B, C, H, W); conv weights (K, C, kh, kw); dense inputs (B, D).
"""
from __future__ import annotations

from hetconv.ops.activation import relu, relu_backward
from hetconv.ops.batchnorm import batch_norm_backward, batch_norm_forward
from hetconv.ops.conv import conv2d, conv2d_backward, conv2d_backward_cached, conv2d_forward_cached
from hetconv.ops.conv_layer import conv_layer_backward, conv_layer_forward
from hetconv.ops.conv_reference import conv2d_backward_reference, conv2d_reference
from hetconv.ops.linear import linear, linear_backward
from hetconv.ops.loss import softmax_cross_entropy, softmax_cross_entropy_backward
from hetconv.ops.pooling import max_pool2x2, max_pool2x2_backward

__all__ = [
                              "batch_norm_backward",
                              "batch_norm_forward",
                              "conv2d",
                              "conv2d_backward",
                              "conv2d_backward_cached",
                              "conv2d_backward_reference",
                              "conv2d_forward_cached",
                              "conv2d_reference",
                              "conv_layer_backward",
                              "conv_layer_forward",
                              "linear",
                              "linear_backward",
                              "max_pool2x2",
                              "max_pool2x2_backward",
                              "relu",
                              "relu_backward",
                              "softmax_cross_entropy",
                              "softmax_cross_entropy_backward",
]
