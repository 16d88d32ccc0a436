"""WeightsWatch: the check that decides when a cached weight layout (a
transpose, packed panels, the lean pass's layers) must be made again.
Optimizers write through ``p.data``: no version bump, same storage."""
import pytest
import torch

from fairseq_specdec.utils.projection import DerivedWeight, ModuleParameters, WeightsWatch, inference_scope, shared_watch


@pytest.fixture
def make_watch():
    return WeightsWatch


def weights():
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(40, 30)), torch.nn.Parameter(torch.randn(30))]


def test_first_look_is_a_change_and_an_unchanged_list_is_not(make_watch):
    w = weights()
    watch = make_watch()
    assert watch.changed(w) and watch.generation == 1
    assert not watch.changed(w) and not watch.changed(w)
    assert watch.generation == 1


def test_in_place_writes_through_data_are_seen_at_a_sampled_element(make_watch):
    w = weights()
    watch = make_watch()
    watch.changed(w)
    version = w[0]._version
    with torch.no_grad():
        w[0].data.view(-1)[0] += 1.0  # element 0 is sampled
    assert w[0]._version == version  # what a version-keyed check would miss
    assert watch.changed(w)
    assert not watch.changed(w)
    with torch.no_grad():
        w[1].data.mul_(-2.0)
    assert watch.changed(w)


def test_a_new_storage_dtype_or_shape_is_seen(make_watch):
    w = weights()
    watch = make_watch()
    watch.changed(w)
    w[0].data = w[0].data.clone()  # same values, another storage
    assert watch.changed(w)
    w[1].data = w[1].data.double()
    assert watch.changed(w)
    w[1].data = torch.randn(31)
    assert watch.changed(w)
    assert watch.changed(w[:1])  # a shorter list
    assert watch.changed([])
    assert not watch.changed([])


def test_every_sampled_element_is_compared_and_an_unsampled_one_is_not(make_watch):
    w = weights()  # 1200 and 30 elements: samples every 75th and every element of the first 16
    watch = make_watch()
    watch.changed(w)
    with torch.no_grad():
        w[0].data.view(-1)[75 * 15] = 123.0  # the last sample
    assert watch.changed(w)
    with torch.no_grad():
        w[1].data[15] = -5.0  # the bias's 16th element, its last sample
    assert watch.changed(w)
    with torch.no_grad():
        w[1].data[16] = -5.0  # not sampled: the watch's stated limit
        w[0].data.view(-1)[1] = -5.0
    assert not watch.changed(w)


def test_a_non_contiguous_weight_is_read_afresh(make_watch):
    base = torch.randn(30, 40)
    w = [base.t()]  # a transposed view: its sampled values are a copy, read at each look
    watch = make_watch()
    watch.changed(w)
    base[0, 0] += 1.0  # w[0][0, 0]
    assert watch.changed(w)
    assert not watch.changed(w)


def test_inference_tensors_are_watched_outside_inference_mode(make_watch):
    with torch.inference_mode():
        w = [torch.randn(40, 30)]
    watch = make_watch()
    assert watch.changed(w)
    assert not watch.changed(w)
    with torch.inference_mode():
        w[0].view(-1)[0] += 1.0
    assert watch.changed(w)


def test_derived_weight_rebuilds_only_when_the_weight_changes():
    w, b = weights()
    built = []
    derived = DerivedWeight(lambda weight, bias: built.append(1) or weight.t().contiguous() + 0 * bias.sum())
    first = derived.get(w, b)
    assert derived.get(w, b) is first and len(built) == 1
    with torch.no_grad():
        w.data.view(-1)[0] = 7.0
    again = derived.get(w, b)
    assert len(built) == 2 and again[0, 0].item() == 7.0


def test_module_parameters_reads_what_parameters_reads_and_sees_a_replaced_parameter(make_watch):
    net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Sequential(torch.nn.Linear(4, 2, bias=False)))
    read = ModuleParameters(net)
    assert [id(p) for p in read()] == [id(p) for p in net.parameters()]
    watch = make_watch()
    assert watch.changed(read())
    assert not watch.changed(read())
    net[2][0].weight = torch.nn.Parameter(net[2][0].weight.detach().clone())  # a new Parameter, equal values
    assert [id(p) for p in read()] == [id(p) for p in net.parameters()]
    assert watch.changed(read())
    net[0].bias = None  # a parameter removed
    assert len(read()) == 2


def test_shared_watch_looks_once_per_scope_and_every_user_sees_a_change():
    """The weights several layouts are made from: one look per inference
    scope, whoever asks; a look at every call outside one; a change seen
    by one user is a new generation for all."""
    owner = torch.nn.Linear(30, 40)
    watch = shared_watch(owner, "layers")
    assert shared_watch(owner, "layers") is watch and shared_watch(owner, "other") is not watch
    assert shared_watch(torch.nn.Linear(30, 40), "layers") is not watch
    looks = []

    def listed():
        looks.append(1)
        return [owner.weight, owner.bias]

    assert watch.look(listed) == 1 and len(looks) == 1  # the first look: generation 1
    with inference_scope():
        assert watch.look(listed) == watch.look(listed) == 1
    assert len(looks) == 2
    with torch.no_grad():
        owner.weight.data.view(-1)[0] += 1.0  # a sampled element, through .data: no version bump
    with inference_scope():
        assert watch.look(listed) == 2 and watch.look(listed) == 2
    assert len(looks) == 3
    assert watch.look(listed) == 2 and watch.look(listed) == 2 and len(looks) == 5  # outside a scope: every call
