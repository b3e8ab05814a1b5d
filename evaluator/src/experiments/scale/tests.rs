//! The simulation checks what it measures: loads return the bytes saved, on
//! every rank, in the saved split and resharded; figures that must grow with
//! the ranks do; a rank count over the budget is skipped, not run.

use std::path::PathBuf;

use super::sim::{fresh_root, load, options, run_ranks, save, Job, SimShape};
use super::state::{self, Shape};
use super::{SimBench, PROBE_RANKS};
use crate::experiments::Ctx;

const SHAPE: SimShape = SimShape {
    state: Shape {
        sharded: 2,
        replicated: 2,
    },
    keep_last: 2,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn saves_and_loads_of_256_ranks_return_the_bytes_saved() {
    let n = 256u64;
    let run = run_ranks(n as usize, SHAPE).await.unwrap();
    // Every rank's boxes, checked byte for byte against what was saved.
    assert_eq!(
        run.load_same.checked_bytes,
        n * state::rank_bytes(SHAPE.state)
    );
    let sharded = SHAPE.state.sharded as u64 * state::ROWS * state::COLS * 4;
    let replicated = SHAPE.state.replicated as u64 * state::COLS * 4;
    let half = run.load_half.as_ref().unwrap();
    assert_eq!(half.ranks, 128);
    assert_eq!(
        half.checked_bytes,
        n * (sharded + state::LOCAL) + n / 2 * replicated
    );
    assert_eq!(run.saves.len(), 3);
    for s in &run.saves {
        // Every rank writes its pieces; rank 0 publishes.
        assert!(s.requests.put >= n, "{:?}", s.requests);
        assert!(s.after_manifest.is_some());
        assert!(s.rank0.calls() > 0 && s.received_max > 0);
    }
    assert!(run.root_bytes > 0 && run.fragment_max_bytes > 0);
    assert!(half.meta_bytes_max > 0 && half.rank_max.get > 0);
    // A same-shape restart reads the root and its own fragment (the
    // replicas' records are in the root), not the replicas' writers' too.
    assert!(
        run.load_same.meta_bytes_max <= run.root_bytes + 2 * run.fragment_max_bytes,
        "{} read, root {} and fragment {}",
        run.load_same.meta_bytes_max,
        run.root_bytes,
        run.fragment_max_bytes
    );
    // Ranks other than rank 0 exchange the same few bytes in a later save.
    assert!(
        run.saves[1].others_max < 2048,
        "{}",
        run.saves[1].others_max
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_of_other_bytes_is_an_error() {
    let (url, inner) = fresh_root("test");
    let job = Job::open(&inner, &url, 4, options(2, false)).await.unwrap();
    save(&job, SHAPE.state, 1, 7).await.unwrap();
    drop(job);
    assert_eq!(
        load(&inner, &url, SHAPE, 2, 4, 7)
            .await
            .unwrap()
            .checked_bytes,
        4 * state::rank_bytes(SHAPE.state) - 2 * SHAPE.state.replicated as u64 * state::COLS * 4
    );
    let e = load(&inner, &url, SHAPE, 2, 4, 8).await.unwrap_err();
    assert!(e.to_string().contains("is not what was saved"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_count_projected_over_the_budget_is_skipped() {
    let ctx = Ctx::new(PathBuf::from("unused"), 1, None, false);
    let bench = SimBench {
        ranks: vec![8, 2],
        shape: SHAPE,
        budget_bytes: 1,
        stored: vec![1, 3],
    };
    let r = bench.run(&ctx).await.unwrap();
    assert_eq!(r.rows.len(), 2);
    let small = r.rows[0].run.as_ref().unwrap();
    assert_eq!(small.ranks, 2);
    let skipped = &r.rows[1];
    assert!(skipped.run.is_none());
    // One count measured: projected to grow linearly with the ranks.
    assert_eq!(
        skipped.projected_received_all,
        Some(small.received_all() * 4)
    );
    let root = r.built_root.as_ref().unwrap();
    assert_eq!((root.ranks, root.tensors), (16384, 1601));
    assert!(root.bytes > 16384 * 64, "{}", root.bytes);
    assert!(skipped
        .skipped
        .as_deref()
        .unwrap()
        .starts_with("skipped: projected"));
    assert_eq!(
        r.stored.iter().map(|k| k.stored).collect::<Vec<_>>(),
        vec![1, 3]
    );
    // The targets and tables render from it.
    assert_eq!(super::render::tables(&r).len(), 3);
    assert!(!super::render::targets(&r).is_empty());
    let probe = SimBench {
        ranks: vec![4096, 1024],
        ..bench
    };
    assert_eq!(probe.counts(), vec![PROBE_RANKS, 1024, 4096]);
}
