//! The snapshot's copies into staging, spread over threads.
//!
//! A save's bytes are rarely spread evenly over its tensors: a language
//! model's embedding and its two AdamW moments are most of its state. Copying
//! whole sources, largest first onto the least loaded thread, left one thread
//! with two of those three (the python experiment's GPT-2-shaped model, 166
//! MiB, on two threads: one copied 98 MiB while the other copied 68). So a
//! source that can copy a part of itself ([`CopySource::copy_range_into`]) is
//! cut into pieces that fill each thread up to an even share; sources that
//! copy only whole are placed first, largest first, as before.

use std::sync::Arc;

use bytes::Bytes;

use crate::error::{Error, Result};
use crate::save::snapshot::CopySource;
use crate::staging::StagingBuf;

/// One copy: the tensor's index, its source and its staging buffer.
pub(crate) type CopyJob = (usize, Arc<dyn CopySource>, StagingBuf);

/// The fewest bytes worth a copy thread of their own: starting and joining a
/// thread takes tens of microseconds, about what a MiB takes to copy.
const MIN_THREAD_BYTES: usize = 4 << 20;

/// The smallest piece a source is cut into: smaller gaps in a thread's share
/// are left, as the cost of a piece is a call and a cache line split.
const MIN_PIECE: usize = 1 << 20;

/// Pieces are cut at multiples of a page, so that a piece's source and its
/// destination keep the alignment the whole source and buffer had.
const CUT: usize = 4096;

/// Copy every job's source into its buffer on at most `threads` threads (the
/// caller's among them) and return the buffers frozen, by tensor index.
pub(crate) fn run(mut jobs: Vec<CopyJob>, threads: usize) -> Result<Vec<(usize, Bytes)>> {
    let bytes: usize = jobs.iter().map(|(_, s, _)| s.len()).sum();
    let units: usize = jobs
        .iter()
        .map(|(_, s, _)| {
            if s.splits() {
                s.len().div_ceil(MIN_THREAD_BYTES).max(1)
            } else {
                1
            }
        })
        .sum();
    let threads = copy_threads(bytes, units, threads);
    {
        let groups = schedule(&mut jobs, bytes, threads)?;
        // The calling thread copies the first group itself: a save's few small
        // tensors (RNG states, copied in a lazy save's stall) start no thread.
        let mut groups = groups.into_iter();
        let mine = groups.next().unwrap_or_default();
        std::thread::scope(|scope| {
            let handles: Vec<_> = groups
                .map(|group| scope.spawn(move || copy_pieces(group)))
                .collect();
            let mut first = copy_pieces(mine);
            for h in handles {
                let r = h
                    .join()
                    .unwrap_or_else(|_| Err(Error::Internal("snapshot thread panicked".into())));
                first = first.and(r);
            }
            first
        })?;
    }
    Ok(jobs
        .into_iter()
        .map(|(i, _, buf)| (i, buf.freeze()))
        .collect())
}

/// Threads that copy `units` pieces of `bytes` in all, at most `threads`: one
/// per [`MIN_THREAD_BYTES`], and never more than there are pieces to give.
fn copy_threads(bytes: usize, units: usize, threads: usize) -> usize {
    threads
        .min(bytes.div_ceil(MIN_THREAD_BYTES))
        .min(units)
        .max(1)
}

/// A part of one source and where it goes.
struct Piece<'a> {
    /// The tensor's index: named when a debug build catches a mutation.
    #[cfg_attr(not(debug_assertions), allow(dead_code))]
    index: usize,
    src: &'a dyn CopySource,
    offset: usize,
    dst: &'a mut [u8],
}

/// Give every byte of `jobs` to one of `threads` groups: sources that copy only
/// whole first (largest first, each to the least loaded group), then the
/// others, largest first, cut to fill the least loaded group up to an even
/// share of `bytes`.
fn schedule(jobs: &mut [CopyJob], bytes: usize, threads: usize) -> Result<Vec<Vec<Piece<'_>>>> {
    let mut groups: Vec<(usize, Vec<Piece<'_>>)> =
        (0..threads.max(1)).map(|_| (0, Vec::new())).collect();
    let share = bytes.div_ceil(groups.len());
    let mut order: Vec<&mut CopyJob> = jobs.iter_mut().collect();
    // Whole-only sources first, each group by size, largest first.
    order.sort_by_key(|(_, s, _)| (s.splits(), std::cmp::Reverse(s.len())));
    for (index, src, buf) in order {
        let src: &dyn CopySource = &**src;
        let mut dst = buf.as_mut_slice();
        if dst.len() != src.len() {
            return Err(Error::Internal(format!(
                "staging buffer of {} bytes for a source of {}",
                dst.len(),
                src.len()
            )));
        }
        let mut offset = 0;
        loop {
            let (load, group) = groups
                .iter_mut()
                .min_by_key(|(load, _)| *load)
                .expect("at least one group");
            let room = share.saturating_sub(*load);
            let take = if !src.splits() || room >= dst.len() || room < MIN_PIECE {
                dst.len()
            } else {
                room / CUT * CUT
            };
            let (head, tail) = std::mem::take(&mut dst).split_at_mut(take);
            *load += take;
            group.push(Piece {
                index: *index,
                src,
                offset,
                dst: head,
            });
            offset += take;
            dst = tail;
            if dst.is_empty() {
                break;
            }
        }
    }
    Ok(groups.into_iter().map(|(_, g)| g).collect())
}

fn copy_pieces(group: Vec<Piece<'_>>) -> Result<()> {
    for p in group {
        // A source that copies only whole is one piece, which the trait's
        // default hands to `copy_into`.
        p.src.copy_range_into(p.offset, p.dst)?;
        #[cfg(debug_assertions)]
        {
            let mut again = vec![0u8; p.dst.len()];
            p.src.copy_range_into(p.offset, &mut again)?;
            if again != *p.dst {
                return Err(Error::InvalidInput(format!(
                    "tensor #{} was modified while its snapshot was being taken; \
                     call wait_snapshot() before mutating state (e.g. before optimizer.step())",
                    p.index
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::save::snapshot::SharedVec;
    use crate::staging::{BusyPolicy, StagingPool};

    #[test]
    fn small_copies_start_no_thread_and_large_ones_share_the_cores() {
        // A lazy save's RNG states (a few KiB) are copied by the caller alone.
        assert_eq!(copy_threads(20 << 10, 4, 8), 1);
        assert_eq!(copy_threads(0, 0, 8), 1);
        // A thread per MIN_THREAD_BYTES, at most `threads`, at most a thread a piece.
        assert_eq!(copy_threads(MIN_THREAD_BYTES + 1, 10, 8), 2);
        assert_eq!(copy_threads(256 << 20, 64, 8), 8);
        assert_eq!(copy_threads(256 << 20, 3, 8), 3);
        assert_eq!(copy_threads(256 << 20, 64, 1), 1);
    }

    /// A source that copies only whole (as the `tch` adapter's do).
    struct Whole(Vec<u8>);

    impl CopySource for Whole {
        fn len(&self) -> usize {
            self.0.len()
        }
        fn copy_into(&self, dst: &mut [u8]) -> Result<()> {
            dst.copy_from_slice(&self.0);
            Ok(())
        }
    }

    fn bytes(n: usize, seed: usize) -> Vec<u8> {
        (0..n).map(|b| (b * 7 + seed + b / 4096) as u8).collect()
    }

    /// Schedules `sources` over `threads` groups; returns each group's bytes
    /// and checks that the pieces cover every source exactly once.
    async fn loads(sources: Vec<Arc<dyn CopySource>>, threads: usize) -> Vec<usize> {
        let lens: Vec<usize> = sources.iter().map(|s| s.len()).collect();
        let pool = StagingPool::new(1 << 30);
        let bufs = pool.acquire(&lens, BusyPolicy::Wait, 1).await.unwrap();
        let total = lens.iter().sum();
        let mut jobs: Vec<CopyJob> = sources
            .into_iter()
            .zip(bufs)
            .enumerate()
            .map(|(i, (s, b))| (i, s, b))
            .collect();
        let groups = schedule(&mut jobs, total, threads).unwrap();
        let mut covered: Vec<Vec<(usize, usize)>> = vec![Vec::new(); lens.len()];
        let mut out = Vec::new();
        for g in &groups {
            out.push(g.iter().map(|p| p.dst.len()).sum());
            for p in g {
                covered[p.index].push((p.offset, p.dst.len()));
                if p.dst.len() != lens[p.index] {
                    assert!(p.src.splits(), "a whole-only source was cut");
                    assert_eq!(p.offset % CUT, 0, "a cut off a page boundary");
                }
            }
        }
        for (i, mut spans) in covered.into_iter().enumerate() {
            spans.sort_unstable();
            let mut at = 0;
            for (o, l) in spans {
                assert_eq!(o, at, "source {i}: a gap or an overlap");
                at += l;
            }
            assert_eq!(at, lens[i], "source {i} not covered");
        }
        out
    }

    #[tokio::test]
    async fn large_sources_are_cut_so_that_threads_copy_even_shares() {
        // A GPT-2-shaped state: three large tensors and many small ones.
        let mut sources: Vec<Arc<dyn CopySource>> = (0..3)
            .map(|i| SharedVec::new(bytes(24 << 20, i)) as Arc<dyn CopySource>)
            .collect();
        sources.extend((0..20).map(|i| SharedVec::new(bytes(300 << 10, i)) as Arc<dyn CopySource>));
        let total: usize = sources.iter().map(|s| s.len()).sum();
        let loads = loads(sources, 2).await;
        let (lo, hi) = (*loads.iter().min().unwrap(), *loads.iter().max().unwrap());
        assert!(
            hi - lo <= MIN_PIECE + CUT,
            "uneven shares: {loads:?} of {total}"
        );
    }

    #[tokio::test]
    async fn sources_that_copy_only_whole_are_never_cut() {
        let sources: Vec<Arc<dyn CopySource>> = vec![
            Arc::new(Whole(bytes(20 << 20, 1))),
            Arc::new(Whole(bytes(3 << 20, 2))),
            SharedVec::new(bytes(9 << 20, 3)),
        ];
        let loads = loads(sources, 2).await;
        // The whole-only 20 MiB fills one group; the others go to the second.
        assert_eq!(loads.iter().max(), Some(&(20 << 20)));
    }

    #[tokio::test]
    async fn run_copies_every_byte_on_one_thread_or_several() {
        for (sizes, threads) in [
            (vec![3, 4096, 100, 1], 8),
            (vec![9 << 20, 5 << 20, 1, 4 << 20, 7], 4),
            (vec![(17 << 20) + 5, 3 << 20, 12345], 3),
        ] {
            let data: Vec<Vec<u8>> = sizes
                .iter()
                .enumerate()
                .map(|(i, &n)| bytes(n, i))
                .collect();
            let sources: Vec<Arc<dyn CopySource>> = data
                .iter()
                .enumerate()
                .map(|(i, d)| {
                    if i % 2 == 0 {
                        SharedVec::new(d.clone()) as Arc<dyn CopySource>
                    } else {
                        Arc::new(Whole(d.clone()))
                    }
                })
                .collect();
            let pool = StagingPool::new(1 << 30);
            let bufs = pool.acquire(&sizes, BusyPolicy::Wait, 1).await.unwrap();
            let jobs: Vec<CopyJob> = sources
                .into_iter()
                .zip(bufs)
                .enumerate()
                .map(|(i, (s, b))| (i, s, b))
                .collect();
            let mut out = run(jobs, threads).unwrap();
            out.sort_by_key(|(i, _)| *i);
            for (i, b) in out {
                assert_eq!(
                    b.as_ref(),
                    data[i].as_slice(),
                    "sizes {sizes:?}, source {i}"
                );
            }
        }
    }
}
