"""AdapterPool: the adapters resident on a shard, keyed by the router's adapter ids.

The router gives each registration an id unique for the server's life and never schedules
requests of more than max_loras distinct ids at once; the shard loads an id on the first
request that carries it and keeps at most max_loras resident. To make room it evicts the least
recently used adapter that no request it still holds uses (a held request keeps its adapter
across steps, and over a preemption the router resends it). An adapter that cannot be served
(adapters off, a bad directory, a rank over the limit, no room) fails the requests that asked
for it alone, with the reason (AdapterError), as the shard's other per-request errors do.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable, Iterable

from pagemill.lora.adapter import AdapterError, PeftAdapter, read_adapter
from pagemill.lora.apply import LoadedAdapter

log = logging.getLogger(__name__)


class AdapterPool:
    def __init__(self, max_loras: int, max_rank: int, fit: Callable[[PeftAdapter, int, str], LoadedAdapter]) -> None:
        """fit(peft, id, name): the adapter on this rank's model (layers.fit_adapter, bound)."""
        self.max_loras, self.max_rank = max_loras, max_rank
        self._fit = fit
        self.resident: OrderedDict[int, LoadedAdapter] = OrderedDict()  # least recently used first
        self.loads = self.evictions = 0

    def acquire(self, adapter, in_use: Iterable[int]) -> LoadedAdapter:
        """The resident adapter for pb.Adapter `adapter`, loaded on first sight; in_use: ids that
        requests held by the shard use (never evicted). Raises AdapterError."""
        if self.max_loras == 0:
            raise AdapterError(f"adapter {adapter.name or adapter.id!r} requested, but LoRA adapters are off on "
                               "this server (max_loras=0)")  # fmt: skip
        hit = self.resident.get(adapter.id)
        if hit is not None:
            self.resident.move_to_end(adapter.id)
            return hit
        if not adapter.path:
            raise AdapterError(f"adapter {adapter.name or adapter.id!r} has no path")
        peft = read_adapter(adapter.path, self.max_rank)  # before evicting: a bad adapter costs no one
        if len(self.resident) >= self.max_loras:
            self._evict(set(in_use))
        loaded = self._fit(peft, adapter.id, adapter.name)
        self.resident[adapter.id] = loaded
        self.loads += 1
        log.info("LoRA adapter %s (id %d, rank %d) loaded from %s: %.1f MB; %d of %d resident", adapter.name,
                 adapter.id, peft.rank, adapter.path, loaded.nbytes / 1e6, len(self.resident),
                 self.max_loras)  # fmt: skip
        return loaded

    def _evict(self, in_use: set[int]) -> None:
        for rid in self.resident:  # oldest use first
            if rid not in in_use:
                gone = self.resident.pop(rid)
                self.evictions += 1
                log.info("LoRA adapter %s (id %d) evicted", gone.name, gone.id)
                return
        raise AdapterError(f"all {self.max_loras} resident LoRA adapters are in use by running requests "
                           "(max_loras); the request cannot load another")  # fmt: skip
