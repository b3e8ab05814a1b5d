//! The fsdp-scale experiment at a tiny size, where the project's interpreter
//! has torch and the ckpt package: both methods' figures on two rank counts,
//! checked bitwise by the script, and the slopes and targets made of them.

use std::time::Duration;

use ckpt_eval::experiments::fsdp_scale::{unavailable, FsdpScaleBench};
use ckpt_eval::experiments::Ctx;

#[test]
fn ckpt_and_dcp_on_two_rank_counts() {
    let dir = tempfile::tempdir().unwrap();
    let c = Ctx::new(
        dir.path().to_path_buf(),
        1,
        ckpt_eval::python::interpreter(),
        false,
    );
    let why = unavailable(c.python.as_deref());
    let Some(py) = c.python.clone().filter(|_| why.is_none()) else {
        assert!(why.is_some(), "a reason is given when it cannot run");
        return;
    };
    let bench = FsdpScaleBench {
        ranks: vec![2, 1],
        blocks: 3,
        width: 8,
        repeats: 2,
        timeout: Duration::from_secs(300),
    };
    let r = bench.run(&c, &py).unwrap();
    let ranks: Vec<usize> = r.runs.iter().map(|x| x.ranks).collect();
    assert_eq!(ranks, [1, 2], "in increasing order");
    for x in &r.runs {
        // 3 weights and AdamW's exp_avg, exp_avg_sq and step of each.
        assert_eq!(x.tensors_per_rank, 12);
        for s in [
            &x.ckpt_save_s,
            &x.ckpt_later_save_s,
            &x.ckpt_load_s,
            &x.dcp_save_s,
            &x.dcp_load_s,
        ] {
            assert!(s.n == 2 && s.min > 0.0 && s.min <= s.max, "{x:?}");
        }
        assert!(x.manifest_bytes > 0 && x.dcp_metadata_bytes > 0, "{x:?}");
        assert!(
            x.manifests_total_bytes > x.manifest_bytes,
            "two checkpoints: {x:?}"
        );
    }
    assert_eq!(r.slopes.len(), 4, "{:?}", r.slopes);
    assert_eq!(r.targets.len(), 4, "{:?}", r.targets);
    assert!(
        std::fs::read_dir(dir.path().join("fsdp-scale")).is_err(),
        "scratch left behind"
    );
}
