//! tch state through the real engine: eager and lazy saves of a `VarStore` and an
//! optimizer, loaded back into a fresh model, on a file store.

use ckpt_core::torch::tch::nn::{self, Module};
use ckpt_core::torch::tch::{self, Device, Kind, Tensor};
use ckpt_core::torch::{restore, Adam, AdamConfig, TorchCapture};
use ckpt_core::{Retention, SnapshotMode, Value};

fn bytes(vs: &nn::VarStore) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<_> = vs
        .variables()
        .into_iter()
        .map(|(k, t)| {
            let t = t.to_device(Device::Cpu).contiguous();
            let mut b = vec![0u8; t.numel() * t.kind().elt_size_in_bytes()];
            t.copy_data_u8(&mut b, t.numel());
            (k, b)
        })
        .collect();
    v.sort();
    v
}

fn net(p: &nn::Path) -> impl Module {
    nn::seq()
        .add(nn::linear(p / "a", 10, 20, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(p / "b", 20, 1, Default::default()))
}

async fn round_trip(mode: SnapshotMode) {
    let dir = tempfile::tempdir().unwrap();
    let cp = ckpt_formats::builder(dir.path().to_str().unwrap())
        .snapshot(mode)
        .retention(Retention::keep_last(2))
        .build()
        .await
        .unwrap();
    let device = if tch::Cuda::is_available() {
        Device::Cuda(0)
    } else {
        Device::Cpu
    };
    tch::manual_seed(4);
    let vs = nn::VarStore::new(device);
    let model = net(&vs.root());
    let mut opt = Adam::new(&vs, AdamConfig::default()).unwrap();
    let x = Tensor::randn([8, 10], (Kind::Float, device));
    let loss = model.forward(&x).square().mean(Kind::Float);
    loss.backward();
    opt.step().unwrap();

    let mut cap = TorchCapture::new();
    cap.var_store("model/", &vs).unwrap();
    opt.capture("optim/", &mut cap).unwrap();
    cap.meta("step", Value::Int(1));
    let saved = bytes(&vs);
    let handle = cp.save(1, cap).await.unwrap();
    handle.wait_snapshot().await.unwrap();
    // After the snapshot the loop may change its state: the checkpoint keeps the old.
    opt.zero_grad();
    model.forward(&x).sum(Kind::Float).backward();
    opt.step().unwrap();
    assert_ne!(bytes(&vs), saved);
    let report = handle.wait().await.unwrap();
    assert_eq!(
        report.raw_bytes,
        cp.load_latest().await.unwrap().unwrap().state.nbytes()
    );

    let loaded = cp.load_latest().await.unwrap().expect("a checkpoint");
    assert_eq!(loaded.id.step, 1);
    tch::manual_seed(5);
    let mut fresh = nn::VarStore::new(device);
    let _m = net(&fresh.root());
    let mut fresh_opt = Adam::new(&fresh, AdamConfig::default()).unwrap();
    restore::var_store(&mut fresh, &loaded.state, "model/").unwrap();
    fresh_opt.restore("optim/", &loaded.state).unwrap();
    assert_eq!(bytes(&fresh), saved);
    assert_eq!(fresh_opt.steps(), 1);
    assert_eq!(loaded.state.meta.get("step"), Some(&Value::Int(1)));
    // Variables stay where the model put them.
    assert!(fresh.variables().values().all(|t| t.device() == device));
}

#[tokio::test]
async fn eager_save_of_a_var_store_loads_back_bitwise() {
    round_trip(SnapshotMode::Eager).await;
}

#[tokio::test]
async fn lazy_save_of_a_var_store_loads_back_bitwise() {
    round_trip(SnapshotMode::Lazy).await;
}
