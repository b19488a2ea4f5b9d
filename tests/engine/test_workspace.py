"""The vision tower's workspace (engine.workspace): the budget keeps a reserve for it before the pool, a prompt's
images are encoded in as many tower calls as keep within it (the same tokens as one call, on the synchronous and the
sliced path), and an image that alone needs more is refused with a typed error naming the bytes, nothing queued."""

from __future__ import annotations

import numpy as np
import pytest

from engine import LLM
from engine.errors import RequestTooLargeError
from engine.workspace import image_patches, workspace_bytes, workspace_groups
from tests.conftest import assert_no_leaked_blocks
from tests.engine.test_qwen_vl import build_prompt, greedy, image, request

CFG = dict(dtype="float32", num_kv_blocks=256, block_size=16, max_num_seqs=4, max_model_len=1024)
SIZES = [(256, 256), (128, 192), (256, 320)]  # 256, 96 and 320 patches


@pytest.fixture(scope="module")
def model_dir(tiny_qwen_ckpt):
    return tiny_qwen_ckpt(max_pixels=512 * 512)


def _calls(llm) -> list[int]:
    """Patches of each tower call the engine makes from now on."""
    tower, seen = llm.engine.model.vision, []
    start = tower.start

    def counted(pixels, grid):
        seen.append(int(np.prod(grid.numpy(), axis=1).sum()))
        return start(pixels, grid)

    tower.start = counted
    return seen


@pytest.mark.parametrize("slice_s", [None, 0.05], ids=["whole", "sliced"])
def test_images_are_encoded_in_calls_within_the_workspace_with_the_same_tokens(model_dir, slice_s):
    ims = [image(i, s) for i, s in enumerate(SIZES)]
    prompt = request(build_prompt(ims, model_dir), ims)
    one_call = LLM(model_dir, **CFG, vision_slice_s=slice_s)
    cfg = one_call.engine.model_config
    calls = _calls(one_call)
    ref = one_call.generate(prompt, greedy(6))[0]
    assert calls == [256 + 96 + 320]  # the default reserve holds a step's worth: one call
    reserve = workspace_bytes(cfg, 256 + 96, 4)  # room for the first two images together, not all three
    small = LLM(model_dir, **CFG, vision_slice_s=slice_s, encoder_workspace_mb=reserve / 2**20)
    assert small.engine.kv_memory().workspace_bytes == small.engine.workspace == int(reserve / 2**20 * 2**20)
    calls = _calls(small)
    got = small.generate(prompt, greedy(6))[0]
    assert calls == [256 + 96, 320]
    assert got.outputs[0].token_ids == ref.outputs[0].token_ids
    assert_no_leaked_blocks(small)


def test_an_image_over_the_workspace_is_refused_typed_and_nothing_queued(model_dir):
    llm = LLM(model_dir, **CFG, encoder_workspace_mb=0.5)
    cfg = llm.engine.model_config
    big = [image(0, (512, 512))]  # 1024 patches
    need = workspace_bytes(cfg, 1024, 4)
    assert need > 0.5 * 2**20
    with pytest.raises(RequestTooLargeError, match=f"{need:,} bytes of vision-tower workspace"):
        llm.engine.add_request("big", request(build_prompt(big, model_dir), big), greedy(2))
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()
    ok = [image(1, (128, 128))]
    assert llm.generate(request(build_prompt(ok, model_dir), ok), greedy(2))[0].finished
    assert_no_leaked_blocks(llm)


def test_workspace_groups_keep_order_and_one_image_a_call_at_least(model_dir):
    cfg = LLM(model_dir, **CFG).engine.model_config

    class MM:
        grid_thw = np.array([[1, 16, 16], [1, 32, 32], [1, 8, 8]])

    todo = {b"a": (type("S", (), {"mm": MM})(), 0), b"b": (type("S", (), {"mm": MM})(), 1),
            b"c": (type("S", (), {"mm": MM})(), 2)}
    assert [image_patches(cfg, MM, i) for i in range(3)] == [256, 1024, 64]
    assert [list(g) for g in workspace_groups(todo, cfg, 0, 4)] == [[b"a", b"b", b"c"]]  # 0: unbounded
    tight = workspace_bytes(cfg, 256, 4)
    # b alone is over the reserve: it still gets a call of its own (admission refuses such prompts beforehand)
    assert [list(g) for g in workspace_groups(todo, cfg, tight, 4)] == [[b"a"], [b"b"], [b"c"]]
    assert [list(g) for g in workspace_groups(todo, cfg, workspace_bytes(cfg, 1024 + 64, 4), 4)] == \
        [[b"a"], [b"b", b"c"]]
