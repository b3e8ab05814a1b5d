//! A rank that does not take part in a save is named, on every rank that
//! waited, in `Error::Stragglers`, within `collective_timeout`: at the first
//! save and at a later one, whether it never comes or is busy elsewhere; a
//! rank that is only late but arrives in time lets the save succeed; a
//! read-only job's agreement on a load names its absent rank too. The
//! ranks are tasks of this process over ckpt-core's `InProcessGroup` (the
//! `mpi` tests run the same under `mpirun`); the store is a local directory.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ckpt_core::testing::InProcessGroup;
use ckpt_core::{Checkpointer, CheckpointerOptions, Coordinator, Error, State};
use ckpt_tests::*;

const TIMEOUT: Duration = Duration::from_secs(3);

fn state(step: u64, rank: usize) -> State {
    // The same on every rank: replicas, stored once.
    let _ = rank;
    f32_state(3, 64, step * 100)
}

async fn open(url: &str, n: usize) -> Vec<Checkpointer> {
    open_with(url, n, false).await
}

async fn open_with(url: &str, n: usize, read_only: bool) -> Vec<Checkpointer> {
    let opens = InProcessGroup::new(n).into_iter().map(|g| {
        let url = url.to_owned();
        tokio::spawn(async move {
            let opts = CheckpointerOptions {
                collective_timeout: TIMEOUT,
                read_only,
                ..Default::default()
            };
            let g: Arc<dyn Coordinator> = g;
            ckpt_formats::builder(&url)
                .coordinator(g)
                .options(opts)
                .build()
                .await
                .unwrap()
        })
    });
    let mut out = Vec::new();
    for o in futures::future::join_all(opens).await {
        out.push(o.unwrap());
    }
    out
}

/// Every rank but `absent` saves `step` (`absent` saves after `late`, or
/// never); each rank's result and how long the ranks that failed took.
async fn save_without(
    cps: &[Checkpointer],
    step: u64,
    absent: usize,
    late: Option<Duration>,
) -> (Vec<Result<(), Error>>, Duration) {
    let t = Instant::now();
    let saves = cps.iter().enumerate().map(|(r, cp)| {
        let cp = cp.clone();
        tokio::spawn(async move {
            if r == absent {
                match late {
                    Some(d) => tokio::time::sleep(d).await,
                    None => return Ok(()),
                }
            }
            cp.save(step, &state(step, r))
                .await?
                .wait()
                .await
                .map(|_| ())
        })
    });
    let mut out = Vec::new();
    for s in futures::future::join_all(saves).await {
        out.push(s.unwrap());
    }
    (out, t.elapsed())
}

/// Every rank but `absent` failed naming `absent` alone, in `phase`.
fn assert_named<T: std::fmt::Debug>(results: &[Result<T, Error>], absent: usize, phase: &str) {
    for (r, res) in results.iter().enumerate() {
        if r == absent {
            continue;
        }
        match res {
            Err(Error::Stragglers {
                ranks, world, what, ..
            }) => {
                assert_eq!(ranks, &vec![absent], "rank {r}");
                assert_eq!(*world, results.len());
                assert!(what.contains(phase), "{what}");
            }
            other => panic!("rank {r}: {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_never_comes_to_the_first_save_is_named_on_every_other_rank() {
    let (_dir, url) = temp_root();
    let cps = open(&url, 4).await;
    let (results, took) = save_without(&cps, 1, 2, None).await;
    assert_named(&results, 2, "save of step 1");
    // Within the timeout (the roll call runs in its reserve), with a margin for a loaded machine.
    assert!(took < TIMEOUT + Duration::from_secs(2), "{took:?}");
    let msg = results[0].as_ref().unwrap_err().to_string();
    assert!(
        msg.contains("1 of 4 ranks were not taking part: 2"),
        "{msg}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_busy_elsewhere_at_a_later_save_is_named_and_nothing_is_committed() {
    let (_dir, url) = temp_root();
    let cps = open(&url, 3).await;
    let (first, _) = save_without(&cps, 1, usize::MAX, None).await;
    assert!(first.iter().all(Result::is_ok), "{first:?}");
    // Rank 0 is the one missing: the root of every gather.
    let (results, _) = save_without(&cps, 2, 0, None).await;
    assert_named(&results, 0, "save of step 2");
    let reader = ckpt_formats::builder(&url)
        .read_only()
        .build()
        .await
        .unwrap();
    let steps: Vec<u64> = reader
        .committed()
        .await
        .unwrap()
        .iter()
        .map(|id| id.step)
        .collect();
    assert_eq!(steps, vec![1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_is_late_but_in_time_lets_the_save_commit() {
    let (_dir, url) = temp_root();
    let cps = open(&url, 3).await;
    // Past the time a waiting rank marks itself present, before the deadline.
    let (results, _) = save_without(&cps, 1, 1, Some(Duration::from_millis(1500))).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    // The marks of the long wait were taken back.
    let marks = std::fs::read_dir(std::path::Path::new(&_dir.path()).join("attendance"))
        .map(|d| {
            d.flat_map(|e| std::fs::read_dir(e.unwrap().path()).unwrap())
                .count()
        })
        .unwrap_or(0);
    assert_eq!(marks, 0);
    // And the next save goes as usual.
    let (results, _) = save_without(&cps, 2, usize::MAX, None).await;
    assert!(results.iter().all(Result::is_ok), "{results:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_job_names_the_rank_absent_from_its_agreement_on_a_load() {
    let (_dir, url) = temp_root();
    let writers = open(&url, 2).await;
    let (saved, _) = save_without(&writers, 1, usize::MAX, None).await;
    assert!(saved.iter().all(Result::is_ok), "{saved:?}");
    drop(writers);
    // An evaluation job of 3 ranks: each loads, then all agree on what they
    // loaded (as the Python restore does); rank 1 never comes to the agreement.
    let readers = open_with(&url, 3, true).await;
    let t = Instant::now();
    let agreements = readers.iter().enumerate().map(|(r, cp)| {
        let cp = cp.clone();
        tokio::spawn(async move {
            let loaded = cp.load_latest().await?.expect("step 1 is committed");
            if r == 1 {
                return Ok(Vec::new());
            }
            cp.all_gather(
                loaded.id.step.to_le_bytes().to_vec(),
                "agreeing on the load",
            )
            .await
        })
    });
    let results: Vec<_> = futures::future::join_all(agreements)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect();
    assert!(
        t.elapsed() < TIMEOUT + Duration::from_secs(4),
        "{:?}",
        t.elapsed()
    );
    assert_named(&results, 1, "agreeing on the load");
    // The readers' marks are all they wrote: no epoch was claimed.
    let epochs = std::fs::read_dir(_dir.path().join("epochs"))
        .map(|d| d.count())
        .unwrap_or(0);
    assert_eq!(epochs, 1, "only the writers' claim");
}
