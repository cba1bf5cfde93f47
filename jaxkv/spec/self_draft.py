"""``self``: the model's first ``num_draft_layers`` layers and its LM head draft greedily on
device, in the target's own steps (`jaxkv.runtime.steps`), over the target's pages: no extra
weights; the row's draft tokens are written into the step's tokens on device."""

from __future__ import annotations

from jaxkv.spec.proposer import DeviceProposer


class SelfDraftProposer(DeviceProposer):
    def draft_program(self, model_config) -> tuple[int, int]:
        """(k, layers) of the draft; ValueError naming num_draft_layers if the draft would be
        the whole model."""
        total = model_config.num_layers
        layers = self.config.num_draft_layers or max(1, total // 2)
        if layers >= total:
            raise ValueError(f"speculative_config.num_draft_layers={layers}: the draft must be "
                             f"fewer layers than the model's {total}")
        return self.k, layers
