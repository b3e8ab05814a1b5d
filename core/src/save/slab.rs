//! [`Slab`]: host memory that something outside the engine fills (a GPU's
//! device-to-host copies), laid out as one slot per tensor and handed to a
//! save without a copy.
//!
//! A snapshot normally copies each tensor into a staging buffer. For a tensor
//! that lives on a GPU the device-to-host copy already lands in host memory,
//! so copying it again would cost a second trip through the CPU's memory. A
//! slab is that landing place: one anonymous page mapping (which a CUDA
//! runtime can page-lock in place, so the copies run at the bus's speed) with
//! a slot per tensor. Slots of [`LEAD_MIN`](crate::staging::LEAD_MIN) bytes or
//! more start [`STAGING_LEAD`] bytes into a page, like staging buffers, so the
//! native format's chunks are written from them with `O_DIRECT`; smaller ones
//! are packed at 64-byte alignment.
//!
//! The mapping is left out of child processes (`MADV_DONTFORK`): at a fork,
//! the kernel would copy every page the device pinned into the child at once.
//!
//! [`Slab::slot`] turns a slot into [`Bytes`] that keep the slab alive; the
//! slab is [`in_use`](Slab::in_use) until the last of them is dropped (the
//! save has written them), and only then may its filler write it again.

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;

use crate::error::{Error, Result};
use crate::staging::pages::{advise_populate, populate_range, PageBuf};
use crate::staging::{LEAD_MIN, STAGING_LEAD};

const PAGE: usize = 4096;
/// Alignment of slots below `LEAD_MIN` bytes (enough for every dtype and SIMD).
const SMALL_ALIGN: usize = 64;

/// One mapping of host memory with a slot for each tensor of a save.
#[derive(Clone)]
pub struct Slab {
    mem: Arc<PageBuf>,
    slots: Arc<[(usize, usize)]>,
    /// Held by this layout's clones and slot bytes (see [`Slab::in_use`]); a
    /// [`relayout`](Slab::relayout) starts a new one.
    users: Arc<()>,
}

/// A slot's bytes, kept alive by the slab's memory.
struct Slot {
    mem: Arc<PageBuf>,
    _users: Arc<()>,
    at: usize,
    len: usize,
}

impl AsRef<[u8]> for Slot {
    fn as_ref(&self) -> &[u8] {
        &self.mem.as_slice()[self.at..self.at + self.len]
    }
}

impl Slab {
    /// A zeroed slab with one slot of each length, in order.
    pub fn new(lens: &[usize]) -> Result<Slab> {
        let (slots, total) = layout(lens)?;
        let mem = PageBuf::zeroed(total)?;
        // Page-locked for a device's copies: not for children (see there).
        mem.keep_from_children();
        Ok(Slab {
            mem: Arc::new(mem),
            slots: slots.into(),
            users: Arc::new(()),
        })
    }

    /// The same memory laid out for `lens`, when it has room and no bytes of
    /// this layout are held: a save of other shapes reuses memory a device
    /// runtime already page-locked, instead of mapping and locking anew.
    /// `None` when it cannot. The two layouts share bytes: the caller uses
    /// this slab no more.
    pub fn relayout(&self, lens: &[usize]) -> Result<Option<Slab>> {
        let (slots, total) = layout(lens)?;
        if self.in_use() || total > self.mem.len() {
            return Ok(None);
        }
        Ok(Some(Slab {
            mem: self.mem.clone(),
            slots: slots.into(),
            users: Arc::new(()),
        }))
    }

    /// The `(offset, length)` of each slot in the mapping.
    pub fn slots(&self) -> &[(usize, usize)] {
        &self.slots
    }

    /// Whether this slab has exactly one slot of each of `lens`, in order
    /// (a save of the same shapes can reuse it).
    pub fn fits(&self, lens: &[usize]) -> bool {
        self.slots.len() == lens.len() && self.slots.iter().zip(lens).all(|(s, l)| s.1 == *l)
    }

    /// Bytes mapped (slots and the padding between them).
    pub fn len(&self) -> usize {
        self.mem.len()
    }

    /// True for a slab without bytes.
    pub fn is_empty(&self) -> bool {
        self.mem.len() == 0
    }

    /// Address of the mapping's first byte (for a filler outside Rust).
    pub fn address(&self) -> usize {
        self.mem.as_slice().as_ptr() as usize
    }

    /// Slot `i` as bytes that keep the slab alive, without a copy.
    ///
    /// The bytes are what the slot holds while they live: its filler must not
    /// write the slab again until [`in_use`](Slab::in_use) is false.
    pub fn slot(&self, i: usize) -> Result<Bytes> {
        let &(at, len) = self
            .slots
            .get(i)
            .ok_or_else(|| Error::InvalidInput(format!("slab has no slot {i}")))?;
        if len == 0 {
            return Ok(Bytes::new());
        }
        Ok(Bytes::from_owner(Slot {
            mem: self.mem.clone(),
            _users: self.users.clone(),
            at,
            len,
        }))
    }

    /// True while bytes of a slot (or another clone of this slab) are alive.
    pub fn in_use(&self) -> bool {
        Arc::strong_count(&self.users) > 1
    }

    /// Map every page of a fresh slab now, on `threads` threads, instead of
    /// one fault at a time in whatever copies into it first (a device-to-host
    /// copy into untouched pageable memory ran at a fifth of its speed, and
    /// page-locking untouched memory took nine times as long as touched).
    ///
    /// It changes no byte, so a save may already hold the slab's slots (a
    /// lazy save hands them to the engine first, and the engine reads them
    /// only once its `Ready` gate opens); nothing may write into the slab
    /// meanwhile (on kernels without `MADV_POPULATE_WRITE` each page's first
    /// byte is read and written back).
    pub fn populate(&self, threads: usize) -> Result<()> {
        self.on_threads(threads, |at, n| {
            populate_range(at, n);
            true
        });
        Ok(())
    }

    /// [`populate`](Self::populate) for a slab that another thread may be
    /// writing into meanwhile (a restore's read fills it): the kernel's
    /// advice alone (`MADV_POPULATE_WRITE`), which changes no byte; where
    /// the kernel lacks it, nothing is touched. Whether every page was mapped.
    pub fn populate_beside_writes(&self, threads: usize) -> bool {
        self.on_threads(threads, |at, n| advise_populate(at, n) == n)
    }

    /// `f(at, len)` over the slab's memory cut in `threads` parts, each on a
    /// thread of its own; whether every call returned true (a call that
    /// panicked panics here).
    fn on_threads(&self, threads: usize, f: impl Fn(usize, usize) -> bool + Sync) -> bool {
        let (base, len) = (self.address(), self.len());
        if len == 0 {
            return true;
        }
        let threads = threads.clamp(1, 64);
        let part = len.div_ceil(threads).next_multiple_of(PAGE);
        let f = &f;
        std::thread::scope(|scope| {
            let parts: Vec<_> = (0..threads)
                .map(|k| k * part)
                .take_while(|&start| start < len)
                .map(|start| {
                    let end = (start + part).min(len);
                    scope.spawn(move || f(base + start, end - start))
                })
                .collect();
            parts
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
                .collect::<Vec<bool>>() // (every part joined before any answer counts)
                .into_iter()
                .all(|ok| ok)
        })
    }
}

impl fmt::Debug for Slab {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Slab({} slots, {} bytes)", self.slots.len(), self.len())
    }
}

/// Each slot's `(offset, length)` and the mapping's total length.
fn layout(lens: &[usize]) -> Result<(Vec<(usize, usize)>, usize)> {
    let overflow = || Error::InvalidInput("slab slots overflow the address space".into());
    let mut slots = Vec::with_capacity(lens.len());
    let mut end = 0usize;
    for &len in lens {
        let at = if len >= LEAD_MIN {
            end.checked_next_multiple_of(PAGE)
                .and_then(|p| p.checked_add(STAGING_LEAD))
                .ok_or_else(overflow)?
        } else {
            end.checked_next_multiple_of(SMALL_ALIGN)
                .ok_or_else(overflow)?
        };
        end = at.checked_add(len).ok_or_else(overflow)?;
        slots.push((at, len));
    }
    Ok((slots, end))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_slots_sit_at_the_staging_lead_and_small_ones_are_packed() {
        let big = LEAD_MIN;
        let slab = Slab::new(&[3, big, 5, big + 1, 0]).unwrap();
        let s = slab.slots();
        assert_eq!(s[0], (0, 3));
        assert_eq!(s[1], (PAGE + STAGING_LEAD, big));
        assert_eq!(s[2].0 % SMALL_ALIGN, 0);
        assert!(s[2].0 >= s[1].0 + big);
        assert_eq!((s[3].0 - STAGING_LEAD) % PAGE, 0);
        assert_eq!(slab.address() % PAGE, 0, "the mapping is page-aligned");
        for w in s.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "slots do not overlap: {w:?}");
        }
        assert!(slab.fits(&[3, big, 5, big + 1, 0]));
        slab.populate(3).unwrap();
        assert!(!slab.fits(&[3, big, 5, big, 0]));
    }

    #[test]
    fn a_free_slab_is_laid_out_anew_in_the_same_memory() {
        let big = LEAD_MIN;
        let slab = Slab::new(&[big * 4, 100]).unwrap();
        let held = slab.slot(0).unwrap();
        assert!(
            slab.relayout(&[big, big]).unwrap().is_none(),
            "not while in use"
        );
        drop(held);
        let again = slab.relayout(&[big, 7, big, big]).unwrap().expect("room");
        assert_eq!(again.address(), slab.address(), "the same memory");
        assert_eq!(again.len(), slab.len());
        assert!(again.fits(&[big, 7, big, big]));
        assert_eq!(
            (again.slots()[2].0 - STAGING_LEAD) % PAGE,
            0,
            "aligned as a new slab"
        );
        assert!(slab.relayout(&[big * 5]).unwrap().is_none(), "no room");
        // Each layout counts its own users.
        let bytes = again.slot(1).unwrap();
        assert!(again.in_use() && !slab.in_use());
        drop(bytes);
        assert!(!again.in_use());
    }

    /// The kernel's flags of the mapping that holds `address` (smaps; the
    /// kernel may have merged it with a neighbour of the same flags).
    #[cfg(target_os = "linux")]
    fn vm_flags(address: usize) -> String {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let holds = |line: &str| {
            let range = line.split_whitespace().next().unwrap_or("");
            let Some((a, b)) = range.split_once('-') else {
                return false;
            };
            match (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                (Ok(a), Ok(b)) => (a..b).contains(&address),
                _ => false,
            }
        };
        let mut lines = smaps.lines().skip_while(|l| !holds(l));
        assert!(lines.next().is_some(), "no mapping holds {address:x}");
        let flags = lines.find(|l| l.starts_with("VmFlags:")).unwrap();
        flags.trim_start_matches("VmFlags:").to_string()
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_slab_is_left_out_of_child_processes() {
        let slab = Slab::new(&[LEAD_MIN, 3 << 20]).unwrap();
        let flags = vm_flags(slab.address());
        assert!(
            flags.split_whitespace().any(|f| f == "dc"),
            "MADV_DONTFORK (dc) in {flags}"
        );
        // Other staging memory is inherited as usual.
        let plain = PageBuf::zeroed(1 << 20).unwrap();
        let flags = vm_flags(plain.as_slice().as_ptr() as usize);
        assert!(!flags.split_whitespace().any(|f| f == "dc"), "{flags}");
    }

    #[test]
    fn populating_beside_a_writer_changes_none_of_its_bytes_and_maps_every_page() {
        // A restore's read fills the slab while another thread maps its pages.
        let slab = Slab::new(&[32 << 20]).unwrap();
        let (at, n) = slab.slots()[0];
        let base = slab.address() + at;
        let mark = |i: usize| (i / PAGE % 251) as u8 + 1;
        let writer = std::thread::spawn(move || {
            for i in (0..n).step_by(PAGE) {
                // SAFETY: inside the slab, which outlives the thread (joined below).
                unsafe { std::ptr::write_volatile((base + i) as *mut u8, mark(i)) };
            }
        });
        let all = slab.populate_beside_writes(4);
        writer.join().unwrap();
        for i in (0..n).step_by(PAGE) {
            // SAFETY: as above; no thread writes any more.
            assert_eq!(unsafe { *((base + i) as *const u8) }, mark(i), "byte {i}");
        }
        if all {
            let (start, len) = (slab.address(), slab.len());
            let mut resident = vec![0u8; len.div_ceil(PAGE)];
            // SAFETY: the slab's own mapping, one status byte per page.
            let rc =
                unsafe { libc::mincore(start as *mut libc::c_void, len, resident.as_mut_ptr()) };
            assert_eq!(rc, 0);
            assert!(resident.iter().all(|r| r & 1 == 1), "every page mapped");
        }
    }

    #[test]
    fn slot_bytes_show_what_was_written_and_keep_the_slab_in_use() {
        let slab = Slab::new(&[4, 8]).unwrap();
        let (at, _) = slab.slots()[1];
        // SAFETY: the slab is not in use; nothing else reads or writes it.
        unsafe {
            std::ptr::copy_nonoverlapping([1u8; 8].as_ptr(), (slab.address() + at) as *mut u8, 8)
        };
        assert!(!slab.in_use());
        let b = slab.slot(1).unwrap();
        assert_eq!(&b[..], &[1u8; 8]);
        assert!(slab.in_use());
        // Populating changes no byte, so it may run while a save holds slots.
        slab.populate(2).unwrap();
        assert_eq!(&b[..], &[1u8; 8]);
        let c = b.slice(2..4);
        drop(b);
        assert!(slab.in_use(), "a slice still holds the slab");
        drop(c);
        assert!(!slab.in_use());
        assert!(matches!(slab.slot(2), Err(Error::InvalidInput(_))));
    }
}
