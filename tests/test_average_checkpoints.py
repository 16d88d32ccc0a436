"""scripts/average-checkpoints.py: the averaged checkpoint holds the mean of the
inputs' parameters and loads through the safe loader, in fairseq-generate too."""
import torch

import specdec_helpers as H

SCRIPT = str(H.ROOT / "scripts" / "average-checkpoints.py")


def test_average_of_last_epochs_is_their_mean_and_loads_safely(ar_checkpoint, toy_bin, tmp_path):
    from fairseq import checkpoint_utils

    import fairseq_specdec  # noqa: F401  (safe globals for torch.load)

    # two "epochs" of the trained model that differ in every float parameter,
    # stored as fairseq's trainer stores them, plus an older one to be skipped
    directory = tmp_path / "ckpts"
    directory.mkdir()
    gen = torch.Generator().manual_seed(0)
    for epoch in (1, 2, 3):
        state = torch.load(ar_checkpoint, map_location="cpu")
        for name, value in state["model"].items():
            if value.is_floating_point():
                value += 0.01 * epoch * torch.randn(value.shape, generator=gen)
        torch.save(state, directory / f"checkpoint{epoch}.pt")
    epochs = [str(directory / f"checkpoint{e}.pt") for e in (2, 3)]
    out = tmp_path / "avg.pt"
    H.run([H.cli("python"), SCRIPT, "--inputs", str(directory), "--num-epoch-checkpoints", "2", "--output", str(out)])

    inputs = [checkpoint_utils.load_checkpoint_to_cpu(p)["model"] for p in epochs]
    averaged = checkpoint_utils.load_checkpoint_to_cpu(str(out))["model"]
    assert set(averaged) == set(inputs[0])
    for name, value in averaged.items():
        expected = (inputs[0][name].double() + inputs[1][name].double()) / 2
        torch.testing.assert_close(value.double(), expected, rtol=0, atol=1e-6)

    # the stock binary, no opt-in variable: the output is a usable checkpoint
    proc = H.generate(toy_bin, str(out), task="draft_verify")
    assert "Translated 50 sentences" in proc.stdout + proc.stderr
