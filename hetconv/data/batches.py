"""Training batches: the seeded order, optional augmentation, prepared ahead in a thread.

:class:`BatchSource` answers ``batch(epoch, position)`` with the images at
``order[position * batch:(position + 1) * batch]`` of ``order =
np.random.default_rng([seed, epoch]).permutation(count)``, the same order the
training loop always used, so runs without augmentation reproduce bit for bit.
With augmentation every image gets a random crop of the zero-padded image (zero
is the mean pixel after normalisation) and a horizontal flip with probability one
half, drawn from ``np.random.default_rng([seed, epoch, position, AUGMENT_STREAM])``:
a batch depends on (seed, epoch, position) only, so a replay after a fault or a
``--resume`` sees the same batches.

:meth:`BatchSource.prefetch` runs ``batch`` for the positions of one epoch in a
background thread, at most ``depth`` batches ahead (a bounded queue). The
iterator is closed by the consumer (``close()`` or ``with``): the thread is told
to stop and joined, also when the consumer stops early or on an exception; an
exception in the thread is raised in the consumer at the batch it concerns.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType

import numpy as np

AUGMENT_STREAM = 0x61756721
"""Fourth seed word of the augmentation generator: keeps it apart from the order's."""
PREFETCH_DEPTH = 2
"""Batches prepared ahead of the one being trained on."""
_POLL_S = 0.05  # how often a blocked producer or consumer looks at the stop flag

Batch = tuple[np.ndarray, np.ndarray]
"""(x float32 (b, C, H, W), labels int64 (b,))."""


def augment_padding(height: int, width: int) -> int:
    """Pixels of zero padding for the random crop: an eighth of the shorter side, at
    least 1 (4 px for 32x32 images, 3 px for 28x28)."""
    return max(1, min(height, width) // 8)


@dataclass(frozen=True)
class Augmentation:
    """Random crop of the image padded by ``padding`` pixels on every side, then a
    horizontal flip with probability ``flip_probability``."""

    padding: int
    flip_probability: float = 0.5

    def apply(self, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """A new float32 (B, C, H, W) array: each image of ``x`` (B, C, H, W) cropped
        and maybe flipped, with draws from ``rng`` in a fixed order (all offsets, then
        all flips)."""
        count, channels, height, width = x.shape
        pad = self.padding
        offsets = rng.integers(0, 2 * pad + 1, size=(count, 2))
        flips = np.less(rng.random(count), self.flip_probability)
        padded = np.zeros((count, channels, height + 2 * pad, width + 2 * pad), dtype=x.dtype)
        padded[:, :, pad:pad + height, pad:pad + width] = x
        out = np.empty_like(x)
        for index in range(count):
            top, left = int(offsets[index, 0]), int(offsets[index, 1])
            crop = padded[index, :, top:top + height, left:left + width]
            out[index] = crop[:, :, ::-1] if flips[index] else crop
        return out


class BatchSource:
    """The training batches of a set: (epoch, position) -> (x, labels).

    images: float32 (N, C, H, W); labels: int64 (N,); batch: images per batch (the
    last batch of an epoch is smaller); seed: the run's seed; augmentation: None
    for the images as they are.
    """

    def __init__(self, images: np.ndarray, labels: np.ndarray, batch: int, seed: int,
                 augmentation: Augmentation | None = None):
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if len(images) != len(labels):
            raise ValueError(f"{len(images)} images but {len(labels)} labels")
        self.images = images
        self.labels = labels
        self.batch_size = batch
        self.seed = seed
        self.augmentation = augmentation
        self._order_lock = threading.Lock()
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, permutation)

    @property
    def count(self) -> int:
        return len(self.images)

    @property
    def steps_per_epoch(self) -> int:
        return -(-self.count // self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        """The permutation of the training set for ``epoch`` (int64 (N,))."""
        with self._order_lock:
            if self._order is None or self._order[0] != epoch:
                self._order = (epoch, np.random.default_rng([self.seed, epoch])
                               .permutation(self.count))
            return self._order[1]

    def batch(self, epoch: int, position: int) -> Batch:
        """(x float32 (b, C, H, W), labels int64 (b,)) of batch ``position`` of ``epoch``."""
        if not 0 <= position < self.steps_per_epoch:
            raise IndexError(f"batch {position} of an epoch of {self.steps_per_epoch}")
        index = self.order(epoch)[position * self.batch_size:(position + 1) * self.batch_size]
        x, labels = self.images[index], self.labels[index]
        if self.augmentation is not None:
            rng = np.random.default_rng([self.seed, epoch, position, AUGMENT_STREAM])
            x = self.augmentation.apply(x, rng)
        return x, labels

    def prefetch(self, epoch: int, start: int = 0,
                 depth: int = PREFETCH_DEPTH) -> Prefetcher:
        """An iterator over the batches ``start, start + 1, ...`` of ``epoch``, made in
        a background thread; close it when done."""
        return Prefetcher(self, epoch, start, depth)


class Prefetcher(Iterator[Batch]):
    """Batches of one epoch from ``start`` on, prepared by one background thread.

    At most ``depth`` finished batches wait in the queue. ``close()`` (also from
    ``with`` and at the end) stops and joins the thread; it is safe to call twice.
    """

    def __init__(self, source: BatchSource, epoch: int, start: int, depth: int):
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        if not 0 <= start <= source.steps_per_epoch:
            raise ValueError(f"start {start} outside an epoch of {source.steps_per_epoch}")
        self.source = source
        self.epoch = epoch
        self.position = start  # the next batch the consumer gets
        self._stop = threading.Event()
        self._queue: queue.Queue[tuple[int, Batch | BaseException]] = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._produce, args=(start,), daemon=True,
                                        name=f"hetconv-batches-epoch{epoch}")
        self._thread.start()

    def _produce(self, start: int) -> None:
        for position in range(start, self.source.steps_per_epoch):
            item: Batch | BaseException
            try:
                item = self.source.batch(self.epoch, position)
            except BaseException as error:  # handed to the consumer, raised there
                item = error
            if not self._put((position, item)) or isinstance(item, BaseException):
                return

    def _put(self, item: tuple[int, Batch | BaseException]) -> bool:
        """Queue ``item``, waiting while the queue is full; False once told to stop."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Batch:
        if self._stop.is_set() or self.position >= self.source.steps_per_epoch:
            self.close()
            raise StopIteration
        while True:
            try:
                position, item = self._queue.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self.close()
                    raise RuntimeError("the batch thread ended without a batch") from None
        if isinstance(item, BaseException):
            self.close()
            raise item
        assert position == self.position, (position, self.position)
        self.position += 1
        return item

    def close(self) -> None:
        """Stop the thread and wait for it (it finishes the batch it is making)."""
        self._stop.set()
        while self._thread.is_alive():
            try:  # make room, so a producer blocked on a full queue sees the flag
                self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=_POLL_S)
        while not self._queue.empty():
            self._queue.get_nowait()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()
