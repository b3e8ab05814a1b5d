//! Unit tests of the tch adapter on real libtorch (CPU; CUDA where a device exists).

use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

use super::*;
use crate::model::state::State;
use crate::model::tensor::Tensor as CkptTensor;
use crate::save::snapshot::{Capture, TensorData};
use crate::sync::MutexExt;
use crate::{DType, Error, Value};

/// torch's generator is global and tests run in parallel: tests that seed or draw
/// hold this lock so that another test cannot draw in between.
static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn rng_lock() -> std::sync::MutexGuard<'static, ()> {
    RNG.lock_unpoisoned()
}

/// Freeze a capture the way the snapshot does: copy every source into a buffer.
fn freeze(cap: Capture) -> State {
    let mut state = State::new().with_meta(cap.meta);
    for t in cap.tensors {
        let data = match t.data {
            TensorData::Shared(b) => b.to_vec(),
            TensorData::Copy(src) | TensorData::CopyNow(src) => {
                let mut buf = vec![0u8; src.len()];
                src.copy_into(&mut buf).expect("copy");
                buf
            }
        };
        state = state.with_tensor(CkptTensor::new(t.name, t.dtype, t.shape, data).expect("valid"));
    }
    state
}

fn bytes_of(t: &Tensor) -> Vec<u8> {
    let t = t.to_device(Device::Cpu).contiguous();
    let n = t.numel() * t.kind().elt_size_in_bytes();
    let mut out = vec![0u8; n];
    t.copy_data_u8(&mut out, t.numel());
    out
}

#[test]
fn kinds_round_trip_and_unsupported_ones_are_refused() {
    for kind in [
        Kind::Uint8,
        Kind::Int8,
        Kind::Int16,
        Kind::Int,
        Kind::Int64,
        Kind::Half,
        Kind::Float,
        Kind::Double,
        Kind::Bool,
        Kind::BFloat16,
        Kind::ComplexFloat,
    ] {
        assert_eq!(kind_of(dtype_of(kind).unwrap()).unwrap(), kind);
    }
    assert!(matches!(dtype_of(Kind::QInt8), Err(Error::Unsupported(_))));
    assert!(matches!(kind_of(DType::U32), Err(Error::Unsupported(_))));
}

#[test]
fn cpu_tensors_of_every_common_kind_round_trip_bitwise() {
    let _rng = rng_lock();
    tch::manual_seed(7);
    let base = Tensor::randn([3, 5], (Kind::Float, Device::Cpu));
    let cases = vec![
        ("f32", base.shallow_clone()),
        ("f64", base.to_kind(Kind::Double)),
        ("bf16", base.to_kind(Kind::BFloat16)),
        ("f16", base.to_kind(Kind::Half)),
        ("i64", (&base * 1000.0).to_kind(Kind::Int64)),
        ("bool", base.gt(0.0)),
        ("scalar", Tensor::from(3.5f64)),
        ("empty", Tensor::zeros([0, 4], (Kind::Float, Device::Cpu))),
        // A transposed view: not contiguous, captured through a private copy.
        ("view", base.tr()),
    ];
    let mut cap = TorchCapture::new();
    for (name, t) in &cases {
        cap.tensor(*name, t).unwrap();
    }
    let state = freeze(cap.into());
    for (name, t) in &cases {
        let saved = state.tensor(name).unwrap();
        assert_eq!(
            saved.shape,
            t.size().iter().map(|&d| d as u64).collect::<Vec<_>>()
        );
        assert_eq!(saved.data.as_ref(), bytes_of(t).as_slice(), "{name}");
        let back = restore::to_tch(saved, Device::Cpu).unwrap();
        assert_eq!(back.kind(), t.kind());
        assert_eq!(bytes_of(&back), bytes_of(t), "{name}");
    }
}

#[test]
fn the_snapshot_reads_the_tensor_at_copy_time() {
    // A capture is a view of live memory until the snapshot copies it: this is
    // why a lazy save must be awaited (wait_snapshot) before the optimizer step.
    let mut t = Tensor::zeros([4], (Kind::Float, Device::Cpu));
    let mut cap = TorchCapture::new();
    cap.tensor("t", &t).unwrap();
    let _ = t.fill_(2.0);
    let state = freeze(cap.into());
    let back = restore::to_tch(state.tensor("t").unwrap(), Device::Cpu).unwrap();
    assert_eq!(Vec::<f32>::try_from(&back).unwrap(), vec![2.0; 4]);
}

fn mlp(vs: &nn::Path) -> impl Module {
    nn::seq()
        .add(nn::linear(vs / "l1", 6, 8, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs / "l2", 8, 2, Default::default()))
}

#[test]
fn var_store_round_trips_and_refuses_mismatches() {
    let _rng = rng_lock();
    tch::manual_seed(1);
    let vs = nn::VarStore::new(Device::Cpu);
    let _net = mlp(&vs.root());
    let mut cap = TorchCapture::new();
    assert_eq!(cap.var_store("model/", &vs).unwrap(), 4);
    cap.meta("step", Value::Int(3));
    let state = freeze(cap.into());
    assert_eq!(state.meta.get("step"), Some(&Value::Int(3)));

    tch::manual_seed(2);
    let mut other = nn::VarStore::new(Device::Cpu);
    let _net2 = mlp(&other.root());
    let differs = |a: &nn::VarStore, b: &nn::VarStore| {
        a.variables()
            .iter()
            .any(|(k, t)| bytes_of(t) != bytes_of(&b.variables()[k]))
    };
    assert!(differs(&vs, &other));
    assert_eq!(restore::var_store(&mut other, &state, "model/").unwrap(), 4);
    assert!(!differs(&vs, &other));

    // A store with another shape is refused before anything is written.
    let mut wrong = nn::VarStore::new(Device::Cpu);
    let _n = nn::linear(wrong.root() / "l1", 6, 9, Default::default());
    let before = bytes_of(&wrong.variables()["l1.weight"]);
    let err = restore::var_store(&mut wrong, &state, "model/").unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)), "{err}");
    assert_eq!(bytes_of(&wrong.variables()["l1.weight"]), before);

    // A variable the checkpoint lacks.
    let mut more = nn::VarStore::new(Device::Cpu);
    let _n = mlp(&more.root());
    let _x = more.root().zeros("extra", &[1]);
    let err = restore::var_store(&mut more, &state, "model/").unwrap_err();
    assert!(matches!(err, Error::NotFound { .. }), "{err}");

    // A checkpoint tensor the store lacks.
    let mut fewer = nn::VarStore::new(Device::Cpu);
    let _n = nn::linear(fewer.root() / "l1", 6, 8, Default::default());
    let err = restore::var_store(&mut fewer, &state, "model/").unwrap_err();
    assert!(matches!(err, Error::InvalidInput(_)), "{err}");
}

#[test]
fn copy_into_refuses_another_dtype() {
    let src = CkptTensor::from_f32("w", vec![2], &[1.0, 2.0]).unwrap();
    let mut dst = Tensor::zeros([2], (Kind::Double, Device::Cpu));
    assert!(matches!(
        restore::copy_into(&mut dst, &src),
        Err(Error::InvalidInput(_))
    ));
}

fn train_steps(vs: &nn::VarStore, opt: &mut Adam, net: &impl Module, from: u64, to: u64) {
    for step in from..to {
        rng::reseed(42, step);
        let x = Tensor::randn([16, 6], (Kind::Float, Device::Cpu));
        let y = x.sum_dim_intlist(1, true, Kind::Float).sin();
        let loss = net
            .forward(&x)
            .mse_loss(&y.repeat([1, 2]), tch::Reduction::Mean);
        opt.zero_grad();
        loss.backward();
        opt.step().unwrap();
    }
    let _ = vs;
}

#[test]
fn adam_resumes_bitwise_from_its_captured_state() {
    let _rng = rng_lock();
    tch::set_num_threads(1);
    tch::manual_seed(3);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs.root());
    let cfg = AdamConfig {
        lr: 0.01,
        weight_decay: 1e-4,
        ..Default::default()
    };
    let mut opt = Adam::new(&vs, cfg).unwrap();
    train_steps(&vs, &mut opt, &net, 0, 5);
    let mut cap = TorchCapture::new();
    cap.var_store("model/", &vs).unwrap();
    opt.capture("optim/", &mut cap).unwrap();
    let state = freeze(cap.into());
    train_steps(&vs, &mut opt, &net, 5, 10);
    let straight: Vec<_> = {
        let mut v: Vec<_> = vs.variables().into_iter().collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v.iter().map(|(_, t)| bytes_of(t)).collect()
    };

    // A fresh process-like start: other init, fresh optimizer, then restore.
    tch::manual_seed(99);
    let mut vs2 = nn::VarStore::new(Device::Cpu);
    let net2 = mlp(&vs2.root());
    let mut opt2 = Adam::new(&vs2, AdamConfig::default()).unwrap();
    restore::var_store(&mut vs2, &state, "model/").unwrap();
    opt2.restore("optim/", &state).unwrap();
    assert_eq!(opt2.steps(), 5);
    assert_eq!(opt2.config(), cfg);
    train_steps(&vs2, &mut opt2, &net2, 5, 10);
    let resumed: Vec<_> = {
        let mut v: Vec<_> = vs2.variables().into_iter().collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v.iter().map(|(_, t)| bytes_of(t)).collect()
    };
    assert_eq!(straight, resumed);

    // Without the optimizer state the run diverges: the test can fail.
    tch::manual_seed(99);
    let mut vs3 = nn::VarStore::new(Device::Cpu);
    let net3 = mlp(&vs3.root());
    let mut opt3 = Adam::new(&vs3, cfg).unwrap();
    restore::var_store(&mut vs3, &state, "model/").unwrap();
    train_steps(&vs3, &mut opt3, &net3, 5, 10);
    let fresh: Vec<_> = {
        let mut v: Vec<_> = vs3.variables().into_iter().collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v.iter().map(|(_, t)| bytes_of(t)).collect()
    };
    assert_ne!(straight, fresh);
}

#[test]
fn adam_named_state_matches_the_capture_and_restores_in_place() {
    let _rng = rng_lock();
    tch::manual_seed(5);
    let vs = nn::VarStore::new(Device::Cpu);
    let net = mlp(&vs.root());
    let mut opt = Adam::new(&vs, AdamConfig::default()).unwrap();
    train_steps(&vs, &mut opt, &net, 0, 3);
    let mut cap = TorchCapture::new();
    opt.capture("optim/", &mut cap).unwrap();
    let state = freeze(cap.into());
    let named = opt.named_state("optim/");
    assert_eq!(named.len(), state.tensors.len());
    for (name, t) in &named {
        assert_eq!(bytes_of(t), state.tensor(name).unwrap().data, "{name}");
    }

    // Copying into the named tensors of a fresh optimizer restores its moments.
    let vs2 = nn::VarStore::new(Device::Cpu);
    let _net2 = mlp(&vs2.root());
    let mut opt2 = Adam::new(&vs2, AdamConfig::default()).unwrap();
    for ((_, mut dst), (_, src)) in opt2.named_state("optim/").into_iter().zip(&named) {
        tch::no_grad(|| dst.copy_(src));
    }
    opt2.set_steps(opt.steps());
    assert_eq!(opt2.steps(), 3);
    let mut cap2 = TorchCapture::new();
    opt2.capture("optim/", &mut cap2).unwrap();
    assert_eq!(freeze(cap2.into()).tensors, state.tensors);
}

#[test]
fn adam_restore_refuses_a_foreign_state() {
    let vs = nn::VarStore::new(Device::Cpu);
    let _net = mlp(&vs.root());
    let mut opt = Adam::new(&vs, AdamConfig::default()).unwrap();
    let state = State::new().with_meta(Value::map([(
        "optim/",
        Value::map([("kind", Value::Str("sgd".into()))]),
    )]));
    assert!(matches!(
        opt.restore("optim/", &state),
        Err(Error::InvalidInput(_))
    ));
    assert!(matches!(
        opt.restore("other/", &state),
        Err(Error::NotFound { .. })
    ));
}

#[test]
fn reseeding_makes_draws_depend_on_seed_and_step_only() {
    let _rng = rng_lock();
    rng::reseed(5, 17);
    let a = Tensor::randn([8], (Kind::Float, Device::Cpu));
    let _ = Tensor::randn([100], (Kind::Float, Device::Cpu));
    rng::reseed(5, 17);
    let b = Tensor::randn([8], (Kind::Float, Device::Cpu));
    rng::reseed(5, 18);
    let c = Tensor::randn([8], (Kind::Float, Device::Cpu));
    assert_eq!(bytes_of(&a), bytes_of(&b));
    assert_ne!(bytes_of(&a), bytes_of(&c));
    assert_ne!(rng::step_seed(1, 2), rng::step_seed(2, 1));
}

#[test]
fn cuda_tensors_round_trip_through_pinned_buffers() {
    let _rng = rng_lock();
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device (the CUDA capture path needs a GPU)");
        return;
    }
    let dev = Device::Cuda(0);
    tch::manual_seed(11);
    let cases = vec![
        ("f32", Tensor::randn([256, 33], (Kind::Float, dev))),
        ("bf16", Tensor::randn([17], (Kind::BFloat16, dev))),
        ("view", Tensor::randn([8, 9], (Kind::Float, dev)).tr()),
        ("empty", Tensor::zeros([0], (Kind::Float, dev))),
    ];
    let expected: Vec<Vec<u8>> = cases.iter().map(|(_, t)| bytes_of(t)).collect();
    let mut cap = TorchCapture::new();
    for (name, t) in &cases {
        cap.tensor(*name, t).unwrap();
    }
    let capture: Capture = cap.into();
    // The copies were queued into page-locked memory.
    for t in &capture.tensors {
        assert!(matches!(t.data, TensorData::Copy(_)));
    }
    let state = freeze(capture);
    for ((name, t), want) in cases.iter().zip(&expected) {
        let saved = state.tensor(name).unwrap();
        assert_eq!(saved.data.as_ref(), want.as_slice(), "{name}");
        let mut live = t.zeros_like();
        restore::copy_into(&mut live, saved).unwrap();
        assert_eq!(live.device(), dev);
        assert_eq!(live.kind(), t.kind());
        assert_eq!(bytes_of(&live), *want, "{name}");
    }
}

#[test]
fn cuda_copies_land_in_pinned_memory() {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device (the CUDA capture path needs a GPU)");
        return;
    }
    let t = Tensor::randn([1024], (Kind::Float, Device::Cuda(0)));
    let fence = std::sync::Arc::new(cuda::CudaFence::default());
    let src = cuda::queue_pinned_copy(&t, 0, &fence).unwrap();
    assert!(
        src.is_pinned(),
        "the non-blocking copy did not use pinned memory"
    );
}

#[test]
fn settle_leaves_cpu_tensors_to_the_snapshot() {
    let t = Tensor::ones([3], (Kind::Float, Device::Cpu));
    let mut cap = TorchCapture::new();
    cap.tensor("t", &t).unwrap();
    cap.settle().unwrap();
    let capture: Capture = cap.into();
    assert!(matches!(capture.tensors[0].data, TensorData::Copy(_)));
}

#[test]
fn settled_cuda_tensors_are_handed_over_without_a_staging_copy() {
    if !tch::Cuda::is_available() {
        eprintln!("skipped: no CUDA device (the CUDA capture path needs a GPU)");
        return;
    }
    let _rng = rng_lock();
    tch::manual_seed(12);
    let dev = Device::Cuda(0);
    let a = Tensor::randn([1000, 7], (Kind::Float, dev));
    let b = Tensor::randn([4, 5], (Kind::BFloat16, dev)).tr();
    let want = [bytes_of(&a), bytes_of(&b)];
    let mut cap = TorchCapture::new();
    cap.tensor("a", &a).unwrap();
    cap.tensor("b", &b).unwrap();
    cap.settle().unwrap();
    let capture: Capture = cap.into();
    for (t, w) in capture.tensors.iter().zip(&want) {
        match &t.data {
            TensorData::Shared(bytes) => assert_eq!(bytes.as_ref(), w.as_slice(), "{}", t.name),
            other => panic!("{} was not settled: {other:?}", t.name),
        }
    }
    // Mutating the device tensor afterwards does not touch the settled bytes.
    let mut a = a;
    let _ = a.fill_(0.0);
    tch::Cuda::synchronize(0);
    let state = freeze(capture);
    assert_eq!(state.tensor("a").unwrap().data.as_ref(), want[0].as_slice());
}
