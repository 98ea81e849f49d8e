"""`extract_hidden_states`: no speculation; the target's hidden states at chosen layers are saved per request, as
vLLM's hidden-states connector does (training data for EAGLE-style draft heads).

Configured as in vLLM:
    speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 18, 33]}}},
    kv_transfer_config={"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                        "kv_connector_extra_config": {"shared_storage_path": "/tmp/hs"}}
When a request finishes, `<shared_storage_path>/<request id>.safetensors` holds `token_ids` [T] (int64) and
`hidden_states` [T, len(layer ids), hidden] for every token the target processed: the prompt (all of it, whatever
the prefill chunking) and every generated token but the last (with max_tokens=1, exactly the prompt, as in vLLM).
Layer id i is the residual stream entering layer i (vLLM's convention), i = num_layers the stream after the last
layer (before the final norm); ids keep the given order. Without ids, EAGLE-3's (2, L // 2, L - 3). The request's
output carries `kv_transfer_params={"hidden_states_path": file}`.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from verispec.proposers.base import Proposal, ProposerNeeds
from verispec.request import Request

CONNECTOR = "ExampleHiddenStatesConnector"
KV_TRANSFER_KEYS = ("kv_connector", "kv_role", "kv_connector_extra_config")


def hidden_states_folder(kv_transfer_config: Mapping[str, Any] | None) -> Path:
    """The shared_storage_path of vLLM's hidden-states connector config (created if missing); ValueError naming the
    key otherwise."""
    example = (
        f'{{"kv_connector": "{CONNECTOR}", "kv_role": "kv_producer", '
        '"kv_connector_extra_config": {"shared_storage_path": "<folder>"}}'
    )
    if kv_transfer_config is None:
        raise ValueError(f"speculative method 'extract_hidden_states' needs kv_transfer_config={example}")
    if not isinstance(kv_transfer_config, Mapping):
        raise ValueError(f"kv_transfer_config must be a dict, e.g. {example}")
    unknown = sorted(set(kv_transfer_config) - set(KV_TRANSFER_KEYS))
    if unknown:
        raise ValueError(
            f"kv_transfer_config: unknown key(s) {unknown}; this build reads {list(KV_TRANSFER_KEYS)}"
        )
    if kv_transfer_config.get("kv_connector") != CONNECTOR:
        raise ValueError(
            f"kv_transfer_config.kv_connector must be '{CONNECTOR}' (the only connector of this build), got "
            f"{kv_transfer_config.get('kv_connector')!r}"
        )
    if kv_transfer_config.get("kv_role", "kv_producer") != "kv_producer":
        raise ValueError(
            f"kv_transfer_config.kv_role must be 'kv_producer', got {kv_transfer_config['kv_role']!r}"
        )
    extra = kv_transfer_config.get("kv_connector_extra_config")
    path = extra.get("shared_storage_path") if isinstance(extra, Mapping) else None
    if not isinstance(path, (str, Path)) or not str(path):
        raise ValueError(
            f"kv_transfer_config.kv_connector_extra_config.shared_storage_path is required: {example}"
        )
    unknown = sorted(set(extra) - {"shared_storage_path"})
    if unknown:
        raise ValueError(
            f"kv_transfer_config.kv_connector_extra_config: unknown key(s) {unknown}; this connector reads "
            "['shared_storage_path']"
        )
    folder = Path(path)
    # created and proven writable now, not when the first request finishes
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except (OSError, ValueError) as e:
        raise ValueError(
            f"kv_transfer_config shared_storage_path {str(folder)!r}: not a writable folder ({e})"
        ) from None
    return folder


class HiddenStatesExtractor:
    def __init__(self, layer_ids: tuple[int, ...], folder: Path):
        self.layer_ids = layer_ids
        # the order the model captures them in, and the way back to the requested order
        captured = tuple(sorted(set(layer_ids)))
        self._columns = [captured.index(i) for i in layer_ids]
        self.needs = ProposerNeeds(aux_layers=captured, observes_states=True)
        self.folder = folder
        self.tokens: dict[str, list[int]] = {}
        # per request: [n, len(layer_ids), H] chunks
        self.states: dict[str, list[torch.Tensor]] = {}

    def add_request(self, req: Request) -> None:
        self.tokens[req.request_id], self.states[req.request_id] = [], []

    def observe_states(
        self, reqs: list[Request], token_ids: list[list[int]], states: list[torch.Tensor]
    ) -> None:
        for r, ids, s in zip(reqs, token_ids, states):
            self.tokens[r.request_id].extend(ids)
            self.states[r.request_id].append(s[:, self._columns])

    def remove_request(self, req: Request, aborted: bool) -> None:
        ids, states = self.tokens.pop(req.request_id, None), self.states.pop(req.request_id, None)
        if aborted or not ids:
            return
        path = self.folder / (re.sub(r"[^A-Za-z0-9_.-]", "_", req.request_id) + ".safetensors")
        save_file(
            {
                "hidden_states": torch.cat(states).cpu().contiguous(),
                "token_ids": torch.tensor(ids, dtype=torch.long),
            },
            str(path),
        )
        req.kv_transfer_params = {"hidden_states_path": str(path)}

    def propose(self, reqs: list[Request], k_max: list[int]) -> Proposal:
        # nothing is speculated
        return Proposal([[] for _ in reqs])

    def observe_hidden(self, reqs, hidden) -> None:
        return None
