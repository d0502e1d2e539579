"""GlobalBatchSampler: the global batches every rank count cuts alike, and repeated augmentation as timm's
RepeatAugSampler (DeiT's RASampler) draws it; step_loader: a step's batches the same from any worker and any start."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter

import pytest
import torch
from timm.data.distributed_sampler import RepeatAugSampler

from lapheads.config import ConfigError, validate_config
from lapheads.errors import InputError
from lapheads.tasks.presets.classify import CLASSIFY_PRESETS
from lapheads.train.classify import collate_images
from lapheads.train.runtime import GlobalBatchSampler, step_loader


def global_batches(sampler_of_rank, world_size: int, steps: int, start: int = 0) -> list[list[int]]:
    """Each step's global batch in its order: micro-batch a of every rank in turn, for a = 0, 1, ..."""
    streams = [sampler_of_rank(rank).step_batches(start) for rank in range(world_size)]
    out = []
    for _ in range(steps):
        shares = [next(stream)[1] for stream in streams]  # each rank's accum_steps micro-batches
        out.append([i for a in range(len(shares[0])) for share in shares for i in share[a]])
    return out


class ShuffledByEpoch(GlobalBatchSampler):
    """The shuffle RepeatAugSampler draws (seeded by the epoch alone), to compare the batches it cuts."""

    def epoch_permutation(self, epoch: int) -> torch.Tensor:
        return torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(epoch))


@pytest.mark.parametrize("world_size, micro_batch, accum_steps", [(1, 48, 1), (2, 24, 1), (4, 6, 2), (8, 6, 1)])
def test_repeated_batches_are_what_timms_repeat_aug_sampler_gives_the_ranks(world_size, micro_batch, accum_steps):
    """Each global batch holds the indices timm's RepeatAugSampler hands all the ranks at that step (a multiset: the
    ranks' shares differ, the step's batch does not), epoch after epoch, and an epoch keeps its length."""
    n, repeats = 1024, 3
    ours = global_batches(
        lambda r: ShuffledByEpoch(n, micro_batch, accum_steps, r, world_size, seed=0, repeats=repeats),
        world_size,
        steps=2 * (n // (micro_batch * accum_steps * world_size)),
    )
    per_step = micro_batch * accum_steps  # what one rank reads a step
    for epoch in range(2):
        theirs = []
        for rank in range(world_size):
            sampler = RepeatAugSampler(range(n), num_replicas=world_size, rank=rank, num_repeats=repeats)
            sampler.set_epoch(epoch)
            theirs.append(list(sampler))
        steps = len(theirs[0]) // per_step  # a DataLoader with drop_last, as DeiT's
        assert steps == n // (micro_batch * accum_steps * world_size)  # an epoch as long as without repeats
        for step in range(steps):
            expected = Counter(i for share in theirs for i in share[step * per_step : (step + 1) * per_step])
            assert Counter(ours[epoch * steps + step]) == expected


def test_each_drawn_image_comes_repeats_times_in_a_row_and_a_third_of_the_images_an_epoch():
    n, global_batch = 960, 96
    sampler = GlobalBatchSampler(n, global_batch, 1, 0, 1, seed=5, repeats=3)
    epoch = [i for _, (micro,) in itertools.islice(sampler.step_batches(0), sampler.steps_per_epoch) for i in micro]
    assert len(epoch) == n and len(set(epoch)) == n // 3
    assert all(len(set(epoch[i : i + 3])) == 1 for i in range(0, n, 3))  # the copies side by side
    assert set(Counter(epoch).values()) == {3}
    other_seed = GlobalBatchSampler(n, global_batch, 1, 0, 1, seed=6, repeats=3)
    assert next(other_seed.step_batches(0))[1] != next(sampler.step_batches(0))[1]  # seeds differ in their order


def test_one_repeat_is_the_plain_shuffle_and_a_resumed_stream_continues_it():
    n, world_size = 500, 2
    plain = global_batches(lambda r: GlobalBatchSampler(n, 20, 2, r, world_size, seed=3), world_size, 30)
    once = global_batches(lambda r: GlobalBatchSampler(n, 20, 2, r, world_size, seed=3, repeats=1), world_size, 30)
    assert once == plain
    perm = GlobalBatchSampler(n, 20, 2, 0, world_size, seed=3).epoch_permutation(0).tolist()
    assert plain[0] == perm[:80] and plain[5] == perm[400:480]  # global batch b: the permutation's b-th slice
    assert len(plain[6]) == 80 and set(plain[6]).isdisjoint(plain[7])  # step 6 starts epoch 1 (6 full batches)
    repeated = lambda r: GlobalBatchSampler(n, 20, 2, r, world_size, seed=3, repeats=3)  # noqa: E731
    assert global_batches(repeated, world_size, 10, start=7) == global_batches(repeated, world_size, 17)[7:]


def _augmented(fmnist_root):
    from lapheads.data.images import build_image_data

    return build_image_data("fashion-mnist", str(fmnist_root), 28, augment=True).train


def test_each_copy_is_augmented_on_its_own(fmnist_root):
    """Repeated augmentation is worth its name only if the copies differ: each is transformed as it is read."""
    sampler = GlobalBatchSampler(512, 12, 1, 0, 1, seed=0, repeats=3)
    _, ((images, labels),) = next(step_loader(_augmented(fmnist_root), sampler, 0, collate_images))
    assert labels[0] == labels[1] == labels[2] and len(set(labels.tolist()[::3])) > 1
    assert not torch.equal(images[0], images[1]) and not torch.equal(images[1], images[2])


def _steps(stream, n: int) -> list[tuple[int, list]]:
    return list(itertools.islice(stream, n))


def _same(a, b) -> bool:
    return all(
        sa == sb and all(torch.equal(x, y) for (xa, la), (xb, lb) in zip(ma, mb) for x, y in ((xa, xb), (la, lb)))
        for (sa, ma), (sb, mb) in zip(a, b)
    )


def test_a_steps_batches_are_the_same_from_any_worker_and_any_start(fmnist_root):
    """Each micro-batch's transforms are seeded by (seed, rank, step, its place): loaded here or in worker processes,
    from step 0 or resumed at step 5, a step's batches are the same; another rank draws its own; and the global
    generators (drop-path, Mixup) see no draw of the loading."""
    train = _augmented(fmnist_root)
    sampler = lambda rank=0: GlobalBatchSampler(512, 8, 2, rank, 2, seed=3)  # noqa: E731
    torch.manual_seed(11)
    here = _steps(step_loader(train, sampler(), 0, collate_images), 9)
    after_loading = torch.rand(3)
    torch.manual_seed(11)
    assert torch.equal(torch.rand(3), after_loading)
    workers = _steps(step_loader(train, sampler(), 0, collate_images, num_workers=2), 9)
    resumed = _steps(step_loader(train, sampler(), 5, collate_images, num_workers=1), 4)
    assert [step for step, _ in here] == list(range(9)) and all(len(micro) == 2 for _, micro in here)
    assert _same(here, workers) and _same(here[5:], resumed)
    other_rank = _steps(step_loader(train, sampler(rank=1), 0, collate_images), 1)
    assert not _same(here[:1], other_rank)
    repeated = GlobalBatchSampler(512, 8, 2, 0, 2, seed=3, repeats=2)  # the same image, drawn twice: two transforms
    (_, ((images, labels), _)), *_ = _steps(step_loader(train, repeated, 0, collate_images), 1)
    assert labels[0] == labels[1] and not torch.equal(images[0], images[1])


def test_bad_repeats_are_one_line():
    with pytest.raises(InputError, match=r"repeats=0; allowed: an integer >= 1"):
        GlobalBatchSampler(100, 10, 1, 0, 1, seed=0, repeats=0)
    assert CLASSIFY_PRESETS["deit3-base-imagenet-official"].aug_repeats == 3  # DeiT-III's --repeated-aug
    assert CLASSIFY_PRESETS["deit3-base-imagenet"].aug_repeats == 1  # the authors' timm scripts: none
    fmnist = CLASSIFY_PRESETS["fmnist-cpu"]
    with pytest.raises(ConfigError, match=r"aug.repeats.* 0.*allowed"):
        validate_config(dataclasses.replace(fmnist, aug_repeats=0))
    with pytest.raises(ConfigError, match=r"--aug-repeats 3 with --augment false: .*allowed: --aug-repeats 1"):
        validate_config(dataclasses.replace(fmnist, aug_repeats=3, augment=False))


def test_a_run_with_aug_repeats_trains_on_the_repeated_batches(tiny_config, tmp_path, monkeypatch):
    """--aug-repeats reaches the trainer's sampler, and config.json says so; the number of loading workers changes
    nothing in the trajectory, and a resume may change it."""
    import lapheads.train.classify as classify
    from lapheads.runs import RunDir

    made: list[GlobalBatchSampler] = []
    monkeypatch.setattr(
        classify, "GlobalBatchSampler", lambda *a, **k: made.append(GlobalBatchSampler(*a, **k)) or made[-1]
    )
    cfg = dataclasses.replace(tiny_config, aug_repeats=4, augment=True, micro_batch=16, epochs=0.25)
    classify.train_classify(cfg, tmp_path / "here")
    assert made[0].repeats == 4 and made[0].accum_steps == 2
    assert RunDir(tmp_path / "here").read_config()["config"]["aug_repeats"] == 4
    workers = dataclasses.replace(cfg, num_workers=2, checkpoint_every=2)
    classify.train_classify(workers, tmp_path / "workers", stop_at_step=3)
    classify.train_classify(dataclasses.replace(workers, num_workers=0), tmp_path / "workers", resume=True)
    weights = [final_weights(tmp_path / name) for name in ("here", "workers")]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def final_weights(run_dir):
    from safetensors.torch import load_file

    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_file(str(run_dir / "checkpoints" / latest / "model.safetensors"))
