//! Staging memory for snapshots: a pool of reusable buffers under a byte budget.
//!
//! A snapshot copies tensors into staging buffers; the buffers become [`Bytes`]
//! that the persist phase reads, and when the last reference drops they return to
//! the pool, so a training loop that saves the same shapes again allocates nothing
//! once warm. Idle buffers count against the budget too; when a save needs room,
//! idle buffers of other sizes are freed first.
//!
//! A buffer of [`LEAD_MIN`] bytes or more starts [`STAGING_LEAD`] bytes past a
//! page boundary: the length of the native format's chunk header. A chunk's
//! data then sits at the same offset within a page in memory as in its file,
//! so a local store writes it with `O_DIRECT` straight from staging instead of
//! copying it through an aligned buffer first (see `store::direct`).
//!
//! The checkpointer owns a pool and the save path borrows from it; this
//! module needs neither. The crate root re-exports [`BusyPolicy`]; the pool
//! itself is here for those that look at it (`Checkpointer::staging`).

pub(crate) mod pages;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use bytes::Bytes;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

use crate::error::{Error, Result};
use crate::sync::MutexExt;
use pages::PageBuf;

const PAGE: u64 = 4096;

/// Bytes between a page boundary and the data of a staging buffer of
/// [`LEAD_MIN`] bytes or more: the native chunk header's length, so chunk data
/// is as aligned in memory as in its stored object.
pub const STAGING_LEAD: usize = 64;
/// Staging buffers from this length on start [`STAGING_LEAD`] bytes into a
/// page; smaller ones are never written from their memory (the local store
/// copies parts below this length) and start on the page.
pub(crate) const LEAD_MIN: usize = crate::store::direct::DIRECT_PART_MIN;

/// Where a staging buffer for `len` bytes starts within its pages.
fn lead(len: usize) -> usize {
    if len >= LEAD_MIN {
        STAGING_LEAD
    } else {
        0
    }
}

/// What a save does when the staging budget is spent by saves still persisting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum BusyPolicy {
    /// Wait until earlier saves release enough staging memory.
    #[default]
    Wait,
    /// Skip this checkpoint and say so ([`Error::Skipped`]).
    Skip,
}

/// Idle buffers by exact length, each with the budget it holds.
type Idle = HashMap<usize, Vec<(PageBuf, OwnedSemaphorePermit)>>;

/// The budget and idle buffers one pool's clones share.
#[derive(Debug)]
struct PoolState {
    budget: u64,
    sem: Arc<Semaphore>,
    returned: Notify,
    idle: Mutex<Idle>,
    /// Saves that mapped buffers of their own so far ([`StagingPool::acquire`]):
    /// a readying ahead stops when it changes (see [`StagingPool::ready_ahead`]).
    acquires: AtomicU64,
    /// Times budget came back or memory came free ([`StagingPool::returns`]).
    returns: AtomicU64,
}

impl PoolState {
    /// Budget came back, or memory came free: wake the waiters.
    fn note_return(&self) {
        self.returns.fetch_add(1, Ordering::SeqCst);
        self.returned.notify_waiters();
    }
}

/// A pool of staging buffers with a byte budget.
#[derive(Debug, Clone)]
pub struct StagingPool {
    inner: Arc<PoolState>,
}

/// A staging buffer on loan from the pool; freeze it into [`Bytes`] after filling it.
#[derive(Debug)]
pub(crate) struct StagingBuf {
    /// `None` only once dropped (the memory went back to the pool).
    data: Option<PageBuf>,
    /// Where the buffer's bytes start in `data` (its lead).
    at: usize,
    permit: Option<OwnedSemaphorePermit>,
    pool: Weak<PoolState>,
}

fn pages(bytes: u64) -> u64 {
    bytes.div_ceil(PAGE)
}

/// The staging memory buffers of these lengths take from a pool's budget:
/// whole pages each, so a state of many small tensors needs more than its
/// bytes (20,000 tensors of 1 KiB: 80 MiB for 20 MiB).
pub(crate) fn staged_bytes(lens: &[usize]) -> u64 {
    lens.iter().map(|&l| pages(l as u64)).sum::<u64>() * PAGE
}

impl StagingPool {
    /// A pool that holds at most `budget` bytes of staging memory, in use or idle.
    pub fn new(budget: u64) -> Self {
        let permits = pages(budget).min(Semaphore::MAX_PERMITS as u64) as usize;
        StagingPool {
            inner: Arc::new(PoolState {
                budget,
                sem: Arc::new(Semaphore::new(permits)),
                returned: Notify::new(),
                idle: Mutex::new(HashMap::new()),
                acquires: AtomicU64::new(0),
                returns: AtomicU64::new(0),
            }),
        }
    }

    /// The budget in bytes.
    pub fn budget(&self) -> u64 {
        self.inner.budget
    }

    /// Bytes held by idle buffers.
    pub fn idle_bytes(&self) -> u64 {
        let idle = self.inner.idle.lock_unpoisoned();
        idle.iter()
            .map(|(len, v)| *len as u64 * v.len() as u64)
            .sum()
    }

    /// Borrow buffers of the given lengths, all or none.
    ///
    /// Buffers of the exact length are reused; new ones are allocated when the
    /// budget allows. When it does not, `policy` decides: wait, or fail with
    /// [`Error::Skipped`] (for `step`).
    pub(crate) async fn acquire(
        &self,
        lens: &[usize],
        policy: BusyPolicy,
        step: u64,
    ) -> Result<Vec<StagingBuf>> {
        // The budget counts whole pages per buffer (`staged_bytes`); a lead
        // adds at most one page to a buffer of 64 KiB or more.
        let total = staged_bytes(lens);
        if pages(total) > pages(self.inner.budget) {
            return Err(Error::InvalidInput(format!(
                "the state needs {total} bytes of staging memory, more than the budget of {} bytes",
                self.inner.budget
            )));
        }
        let mut out: Vec<Option<StagingBuf>> = lens.iter().map(|&l| self.take_idle(l)).collect();
        let missing: u64 = lens
            .iter()
            .zip(&out)
            .filter(|(_, b)| b.is_none())
            .map(|(&l, _)| pages(l as u64))
            .sum();
        let permit = if missing == 0 {
            None
        } else {
            // This save maps buffers: a readying in progress stops at its
            // next piece (see `ready_ahead`). One whose buffers were all
            // idle (a loop's later saves, or none at all) lets it go on.
            self.inner.acquires.fetch_add(1, Ordering::SeqCst);
            let got = self.permits(missing as u32, policy, step, None).await?;
            Some(got.ok_or_else(|| Error::Internal("staging wait ended early".into()))?)
        };
        let mut permit = permit;
        for (slot, &len) in out.iter_mut().zip(lens) {
            if slot.is_none() {
                let p = permit
                    .as_mut()
                    .and_then(|p| p.split(pages(len as u64) as usize));
                *slot = Some(StagingBuf {
                    data: Some(PageBuf::zeroed(len + lead(len))?),
                    at: lead(len),
                    permit: p,
                    pool: Arc::downgrade(&self.inner),
                });
            }
        }
        Ok(out
            .into_iter()
            .map(|b| b.expect("every slot filled"))
            .collect())
    }

    /// Ready idle buffers for a save that will ask for `lens`, ahead of it:
    /// mapped, and their pages faulted in now instead of during the save's
    /// copy (a process's first eager save of a GPT-2's 166 MiB spent 130 ms
    /// of its 134 ms stall there, against 10 ms for a later save). Lengths
    /// that idle buffers already cover are skipped. Takes only budget that is
    /// free now: it never waits, and never frees other idle buffers; what does
    /// not fit is left to the save. Blocks for the page faults (about as long
    /// as that first copy): call it off the training thread. Returns the bytes
    /// readied.
    ///
    /// A save that maps buffers meanwhile stops it at the next piece of its
    /// page faults: it takes the buffers readied so far (the one being
    /// mapped is let go) and maps the rest itself, unfaulted. It must not
    /// wait: each mapping of a new buffer by the save waits for the piece
    /// being faulted in (the kernel's lock of the address space), so a save
    /// of GPT-2's 600 tensors (1.4 GiB) that came just after the first
    /// optimizer step stalled for 2.0 s.
    pub fn ready_ahead(&self, lens: &[usize]) -> Result<u64> {
        let inner = &self.inner;
        let began = inner.acquires.load(Ordering::SeqCst);
        let go_on = || inner.acquires.load(Ordering::SeqCst) == began;
        // How many buffers of each mapped length the save takes.
        let mut want: HashMap<usize, (usize, usize)> = HashMap::new();
        for &len in lens {
            want.entry(len + lead(len)).or_insert((len, 0)).1 += 1;
        }
        let mut readied = 0u64;
        for (mapped, (len, n)) in want {
            let have = self
                .inner
                .idle
                .lock_unpoisoned()
                .get(&mapped)
                .map_or(0, Vec::len);
            for _ in have..n {
                if !go_on() {
                    return Ok(readied);
                }
                let sem = self.inner.sem.clone();
                let free = u32::try_from(pages(len as u64))
                    .ok()
                    .and_then(|p| sem.try_acquire_many_owned(p).ok());
                let Some(permit) = free else {
                    return Ok(readied);
                };
                let buf = PageBuf::zeroed(mapped)?;
                if !buf.populate_while(go_on) {
                    // The save mapped its own for this length: one kept idle
                    // would hold memory (up to the largest tensor's) for nothing.
                    return Ok(readied);
                }
                readied += len as u64;
                self.inner
                    .idle
                    .lock_unpoisoned()
                    .entry(mapped)
                    .or_default()
                    .push((buf, permit));
            }
        }
        Ok(readied)
    }

    fn take_idle(&self, len: usize) -> Option<StagingBuf> {
        let mut idle = self.inner.idle.lock_unpoisoned();
        let (data, permit) = idle.get_mut(&(len + lead(len)))?.pop()?;
        Some(StagingBuf {
            data: Some(data),
            at: lead(len),
            permit: Some(permit),
            pool: Arc::downgrade(&self.inner),
        })
    }

    /// Charge `bytes` (whole pages) of host memory the pool does not map
    /// itself (a slab a GPU copies a snapshot into) to the budget, until the
    /// [`Charge`] drops; one larger than the budget takes all of it. Idle
    /// buffers are freed first to make room. When the rest is held, `policy`
    /// decides: `Skip` fails with [`Error::Skipped`] at once; `Wait` blocks
    /// until it fits, or, given `since` (a [`returns`](Self::returns)
    /// reading), returns `None` once anything came back after it, so that
    /// the caller can look again for memory of its own to reuse.
    pub async fn charge(
        &self,
        bytes: u64,
        policy: BusyPolicy,
        step: u64,
        since: Option<u64>,
    ) -> Result<Option<Charge>> {
        let n = pages(bytes)
            .min(pages(self.inner.budget))
            .min(Semaphore::MAX_PERMITS as u64) as u32;
        let permit = self.permits(n, policy, step, since).await?;
        Ok(permit.map(|p| Charge {
            permit: Some(p),
            pool: Arc::downgrade(&self.inner),
        }))
    }

    /// How many times budget came back or memory came free so far (see
    /// [`charge`](Self::charge) and [`nudge`](Self::nudge)).
    pub fn returns(&self) -> u64 {
        self.inner.returns.load(Ordering::SeqCst)
    }

    /// Memory charged to this pool came free for reuse without its charge
    /// coming back (a slab a save let go of): wake the waiting charges.
    pub fn nudge(&self) {
        self.inner.note_return();
    }

    /// Bytes of the budget free now.
    pub fn free_bytes(&self) -> u64 {
        (self.inner.sem.available_permits() as u64 * PAGE).min(self.inner.budget)
    }

    async fn permits(
        &self,
        n: u32,
        policy: BusyPolicy,
        step: u64,
        since: Option<u64>,
    ) -> Result<Option<OwnedSemaphorePermit>> {
        loop {
            // Register for "a buffer came back" before looking, so no wake-up is lost.
            let returned = self.inner.returned.notified();
            tokio::pin!(returned);
            returned.as_mut().enable();
            if let Ok(p) = self.inner.sem.clone().try_acquire_many_owned(n) {
                return Ok(Some(p));
            }
            // Idle buffers hold budget: free them (their permits go back) and retry.
            let freed = {
                let mut idle = self.inner.idle.lock_unpoisoned();
                let had = !idle.is_empty();
                idle.clear();
                had
            };
            if freed {
                continue;
            }
            match policy {
                BusyPolicy::Wait if since.is_some_and(|s| s != self.returns()) => return Ok(None),
                BusyPolicy::Wait => returned.await,
                BusyPolicy::Skip => {
                    return Err(Error::Skipped {
                        step,
                        reason: "staging budget is in use by saves still persisting".into(),
                    })
                }
            }
        }
    }
}

/// Budget held for memory outside the pool's buffers ([`StagingPool::charge`]),
/// given back when dropped.
#[derive(Debug)]
pub struct Charge {
    permit: Option<OwnedSemaphorePermit>,
    pool: Weak<PoolState>,
}

impl Charge {
    /// Bytes of the budget held (whole pages).
    pub fn bytes(&self) -> u64 {
        self.permit
            .as_ref()
            .map_or(0, |p| p.num_permits() as u64 * PAGE)
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        drop(self.permit.take());
        if let Some(pool) = self.pool.upgrade() {
            pool.note_return();
        }
    }
}

impl StagingBuf {
    /// The buffer to fill.
    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        match self.data.as_mut() {
            Some(d) => &mut d.as_mut_slice()[self.at..],
            None => &mut [],
        }
    }

    /// Freeze into [`Bytes`] (no copy); the buffer returns to the pool when the
    /// last clone of the `Bytes` drops.
    pub(crate) fn freeze(self) -> Bytes {
        Bytes::from_owner(self)
    }
}

impl AsRef<[u8]> for StagingBuf {
    fn as_ref(&self) -> &[u8] {
        match self.data.as_ref() {
            Some(d) => &d.as_slice()[self.at..],
            None => &[],
        }
    }
}

impl Drop for StagingBuf {
    fn drop(&mut self) {
        let (Some(pool), Some(permit), Some(data)) =
            (self.pool.upgrade(), self.permit.take(), self.data.take())
        else {
            return;
        };
        pool.idle
            .lock_unpoisoned()
            .entry(data.len())
            .or_default()
            .push((data, permit));
        pool.note_return();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Large buffers start STAGING_LEAD bytes into a page (chunk data then
    /// sits in memory as it sits in its file), small ones on the page; both
    /// keep their lead when reused.
    #[tokio::test]
    async fn large_buffers_start_the_chunk_header_length_into_a_page() {
        let pool = StagingPool::new(16 << 20);
        for round in 0..2 {
            let mut bufs = pool
                .acquire(&[LEAD_MIN, LEAD_MIN - 1, 3 << 20], BusyPolicy::Skip, round)
                .await
                .unwrap();
            let offsets: Vec<usize> = bufs
                .iter_mut()
                .map(|b| b.as_mut_slice().as_ptr() as usize % PAGE as usize)
                .collect();
            assert_eq!(offsets, [STAGING_LEAD, 0, STAGING_LEAD], "round {round}");
            let lens: Vec<usize> = bufs.iter().map(|b| b.as_ref().len()).collect();
            assert_eq!(lens, [LEAD_MIN, LEAD_MIN - 1, 3 << 20]);
            drop(bufs);
        }
    }

    /// Buffers readied ahead are the ones a save of those lengths takes;
    /// readying again adds nothing, and it never takes budget held elsewhere.
    #[tokio::test]
    async fn buffers_readied_ahead_are_what_the_save_takes() {
        let lens = [3 << 20, 4096, 4096, LEAD_MIN];
        let pool = StagingPool::new(8 << 20);
        let total: u64 = lens.iter().map(|&l| l as u64).sum();
        assert_eq!(pool.ready_ahead(&lens).unwrap(), total);
        assert_eq!(pool.idle_bytes(), total + 2 * STAGING_LEAD as u64);
        assert_eq!(pool.ready_ahead(&lens).unwrap(), 0, "already ready");
        let idle: Vec<usize> = {
            let idle = pool.inner.idle.lock_unpoisoned();
            let mut v: Vec<usize> = idle
                .values()
                .flatten()
                .map(|(b, _)| b.as_slice().as_ptr() as usize)
                .collect();
            v.sort_unstable();
            v
        };
        let mut bufs = pool.acquire(&lens, BusyPolicy::Skip, 1).await.unwrap();
        let mut taken: Vec<usize> = bufs
            .iter_mut()
            .map(|b| b.as_mut_slice().as_ptr() as usize - b.at)
            .collect();
        taken.sort_unstable();
        assert_eq!(taken, idle, "the save took the readied buffers");
        assert_eq!(pool.idle_bytes(), 0);
        // While they are in use, readying more takes only the free budget
        // (8 MiB less the 3 MiB and change held): one more 3 MiB buffer.
        assert_eq!(pool.ready_ahead(&[3 << 20, 3 << 20]).unwrap(), 3 << 20);
        drop(bufs);
    }

    /// A save that maps buffers while a readying is under way stops it:
    /// the readying adds no buffer after the save's but one it had just
    /// mapped (one part-mapped is let go), and returns what it readied.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_save_stops_a_readying_under_way() {
        let lens = vec![32 << 10; 4000]; // (below LEAD_MIN: mapped as long as asked)
        let pool = StagingPool::new(1 << 30);
        let readying = {
            let (pool, lens) = (pool.clone(), lens.clone());
            std::thread::spawn(move || pool.ready_ahead(&lens).unwrap())
        };
        while pool.idle_bytes() == 0 {
            std::thread::yield_now();
        }
        let taken = pool.acquire(&[1 << 20], BusyPolicy::Wait, 1).await.unwrap();
        let idle_then = pool.idle_bytes();
        let readied = readying.join().unwrap();
        let all: u64 = lens.iter().map(|&l| l as u64).sum();
        assert!(readied < all, "stopped early: {readied} of {all} bytes");
        assert!(
            pool.idle_bytes() <= idle_then + (32 << 10),
            "at most the buffer whose mapping was done as the save came was added after it: {} then {idle_then}",
            pool.idle_bytes()
        );
        // A readying that starts after the save goes on to the end, and a
        // save that maps nothing (its buffers idle, or none) does not stop one.
        drop(taken);
        let more = {
            let pool = pool.clone();
            std::thread::spawn(move || pool.ready_ahead(&[16 << 10; 4000]).unwrap())
        };
        while pool.inner.idle.lock_unpoisoned().get(&(16 << 10)).is_none() {
            std::thread::yield_now();
        }
        let none = pool.acquire(&[], BusyPolicy::Wait, 2).await.unwrap();
        let idle_one = pool.acquire(&[1 << 20], BusyPolicy::Wait, 3).await.unwrap();
        assert_eq!(more.join().unwrap(), 4000 * (16 << 10), "not stopped");
        drop((none, idle_one));
        pool.ready_ahead(&[32 << 10; 8000]).unwrap();
        assert_eq!(pool.inner.idle.lock_unpoisoned()[&(32 << 10)].len(), 8000);
    }

    /// A charge (a host slab) and staging buffers take from one budget: a
    /// charge frees idle buffers to fit, a buffer waits for a charge to go,
    /// and a charge that waits with `since` comes back empty on a nudge.
    #[tokio::test]
    async fn charges_and_buffers_share_one_budget() {
        let pool = StagingPool::new(1 << 20);
        drop(
            pool.acquire(&[512 << 10], BusyPolicy::Skip, 1)
                .await
                .unwrap(),
        );
        assert!(pool.idle_bytes() >= 512 << 10);
        let slab = pool.charge(768 << 10, BusyPolicy::Skip, 2, None).await;
        let slab = slab.unwrap().expect("charged");
        assert_eq!(slab.bytes(), 768 << 10);
        assert_eq!(pool.idle_bytes(), 0, "the idle buffer was freed to fit it");
        let err = pool.acquire(&[512 << 10], BusyPolicy::Skip, 3).await;
        assert!(matches!(err, Err(Error::Skipped { step: 3, .. })));
        let err = pool.charge(512 << 10, BusyPolicy::Skip, 4, None).await;
        assert!(matches!(err, Err(Error::Skipped { step: 4, .. })));
        let since = pool.returns();
        let waiter = {
            let pool = pool.clone();
            tokio::spawn(async move {
                let got = pool
                    .charge(512 << 10, BusyPolicy::Wait, 5, Some(since))
                    .await;
                got.map(|c| c.is_none())
            })
        };
        tokio::task::yield_now().await;
        pool.nudge();
        assert!(
            waiter.await.unwrap().unwrap(),
            "woken without room: nothing charged"
        );
        let buf = {
            let pool = pool.clone();
            tokio::spawn(async move { pool.acquire(&[512 << 10], BusyPolicy::Wait, 6).await })
        };
        tokio::task::yield_now().await;
        drop(slab);
        assert_eq!(
            buf.await.unwrap().unwrap().len(),
            1,
            "the charge's budget went to the save"
        );
        let whole = pool
            .charge(4 << 20, BusyPolicy::Skip, 7, None)
            .await
            .unwrap();
        assert_eq!(
            whole.map(|c| c.bytes()),
            Some(1 << 20),
            "more than the budget takes all of it"
        );
    }

    #[tokio::test]
    async fn reuses_buffers_and_respects_budget() {
        let pool = StagingPool::new(1 << 20);
        let bufs = pool
            .acquire(&[4096, 8192], BusyPolicy::Skip, 1)
            .await
            .unwrap();
        let ptr = bufs[0].as_ref().as_ptr();
        let frozen: Vec<Bytes> = bufs.into_iter().map(StagingBuf::freeze).collect();
        drop(frozen);
        assert_eq!(pool.idle_bytes(), 4096 + 8192);
        let again = pool.acquire(&[4096], BusyPolicy::Skip, 2).await.unwrap();
        assert_eq!(again[0].as_ref().as_ptr(), ptr, "the idle buffer is reused");

        // While 1 MiB is held, a second MiB does not fit: Skip says so.
        drop(again);
        let held = pool.acquire(&[1 << 20], BusyPolicy::Skip, 3).await.unwrap();
        let err = pool
            .acquire(&[4096], BusyPolicy::Skip, 4)
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Skipped { step: 4, .. }));
        // Wait gets it once the holder is done.
        let waiter = {
            let pool = pool.clone();
            tokio::spawn(async move {
                pool.acquire(&[4096], BusyPolicy::Wait, 5)
                    .await
                    .map(|b| b.len())
            })
        };
        tokio::task::yield_now().await;
        // Returning the buffer wakes the waiter, which frees the idle 1 MiB to fit.
        drop(held);
        assert_eq!(waiter.await.unwrap().unwrap(), 1);
        assert!(matches!(
            pool.acquire(&[2 << 20], BusyPolicy::Wait, 7).await,
            Err(Error::InvalidInput(_))
        ));
    }
}
