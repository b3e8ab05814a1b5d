//! [`PageBuf`]: staging memory mapped straight from the kernel, page by page.
//!
//! Staging buffers are few, large and long-lived (a training loop reuses them
//! save after save), which is what a general-purpose allocator handles worst:
//! through the process allocator the buffers of a 768 MiB state took 890 MiB
//! (16% more than the bytes staged). An anonymous mapping costs exactly its
//! pages, is zero without being written, and starts page-aligned. Buffers of
//! 2 MiB and more ask for transparent huge pages (`MADV_HUGEPAGE`), so a first
//! snapshot faults its memory in 2 MiB at a time instead of 4 KiB (where the
//! kernel has them to give; otherwise it falls back to small pages).

use std::fmt;
use std::ptr::NonNull;

use crate::error::{Error, Result};

/// The page size the fallback of `populate_range` steps by (the smallest
/// page of the platforms ckpt runs on; a larger page is touched several times).
const PAGE: usize = 4096;

/// Buffers at least this long ask for transparent huge pages.
const HUGE: usize = 2 << 20;

/// A zero-initialised, page-aligned buffer of anonymous memory.
pub(crate) struct PageBuf {
    ptr: NonNull<u8>,
    len: usize,
    /// Bytes mapped (`len` rounded up to a page); 0 for an empty buffer.
    mapped: usize,
}

// SAFETY: `PageBuf` owns its mapping exclusively, like a `Vec<u8>`; shared
// references only read it.
unsafe impl Send for PageBuf {}
// SAFETY: as above; `&PageBuf` gives only `&[u8]`.
unsafe impl Sync for PageBuf {}

fn page_size() -> usize {
    // SAFETY: sysconf reads a constant of the system.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}

impl PageBuf {
    /// `len` zero bytes; an error (not an abort) when the memory cannot be had.
    pub fn zeroed(len: usize) -> Result<Self> {
        if len == 0 {
            return Ok(PageBuf {
                ptr: NonNull::dangling(),
                len: 0,
                mapped: 0,
            });
        }
        let mapped = len
            .checked_next_multiple_of(page_size())
            .ok_or_else(|| too_big(len, "the length overflows"))?;
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                mapped,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            let e = std::io::Error::last_os_error();
            return Err(too_big(len, &e.to_string()));
        }
        #[cfg(target_os = "linux")]
        if mapped >= HUGE {
            // SAFETY: advice about the mapping made above; failure only means small pages.
            unsafe { libc::madvise(p, mapped, libc::MADV_HUGEPAGE) };
        }
        Ok(PageBuf {
            // mmap never returns null on success.
            ptr: NonNull::new(p.cast::<u8>()).ok_or_else(|| too_big(len, "null mapping"))?,
            len,
            mapped,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Leave this mapping out of child processes (`MADV_DONTFORK`), for memory
    /// a device reads by DMA (a page-locked slab). At a `fork` (a DataLoader
    /// worker) the kernel would otherwise copy every page the device pins into
    /// the child at once, and on older kernels a write by the parent after the
    /// fork could land on a copy instead of the page the device reads. A
    /// child never uses ckpt's staging memory.
    pub fn keep_from_children(&self) {
        #[cfg(target_os = "linux")]
        if self.mapped > 0 {
            // SAFETY: advice about this buffer's own mapping; failure (an old
            // kernel) only means the mapping is inherited as before.
            unsafe { libc::madvise(self.ptr.as_ptr().cast(), self.mapped, libc::MADV_DONTFORK) };
        }
    }

    /// Map every page now (for writing), not at the first copy into it:
    /// a first snapshot into fresh memory spent most of its time in page
    /// faults. Nothing may use the buffer meanwhile (on kernels without
    /// `MADV_POPULATE_WRITE` each page's first byte is read and written back).
    ///
    /// One piece of [`POPULATE_PIECE`] bytes at a time, while `go_on()`
    /// holds; returns whether every page was mapped. A buffer left
    /// part-mapped is as usable as one never mapped.
    pub fn populate_while(&self, go_on: impl Fn() -> bool) -> bool {
        let at = self.ptr.as_ptr() as usize;
        let mut done = 0;
        while done < self.mapped {
            if !go_on() {
                return false;
            }
            let n = POPULATE_PIECE.min(self.mapped - done);
            populate_range(at + done, n);
            done += n;
        }
        true
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` bytes of the mapping (or a dangling pointer with 0),
        // initialised (zero or written), borrowed for the lifetime of `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes the borrow exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

/// Bytes populated per call: the kernel holds the process's address-space
/// lock (read) through each call, and a thread of the training that maps
/// memory meanwhile waits for it (populating 4 GiB in 512 MiB calls stalled a
/// save on the training thread by 0.14 s; 15 GiB by 0.77 s).
const POPULATE_PIECE: usize = 16 << 20;

/// Fault in `[at, at + len)` (page-aligned `at`) for writing.
pub(crate) fn populate_range(at: usize, len: usize) {
    // Older kernels refuse the advice; then touch each page it did not map.
    let mut p = at + advise_populate(at, len);
    while p < at + len {
        // SAFETY: inside the caller's mapping, which nothing else uses
        // meanwhile; a zero is written where a zero already is (fresh
        // anonymous pages) or over bytes the next fill overwrites.
        unsafe { std::ptr::write_volatile(p as *mut u8, std::ptr::read_volatile(p as *const u8)) };
        p += PAGE;
    }
}

/// Fault in `[at, at + len)` (page-aligned `at`) for writing with the
/// kernel's advice alone (`MADV_POPULATE_WRITE`, Linux 5.14): it maps the
/// pages without changing a byte, so another thread may write into the range
/// meanwhile. Returns the bytes mapped from `at` on: fewer than `len` where
/// the kernel refused the advice (none on an older kernel).
pub(crate) fn advise_populate(at: usize, len: usize) -> usize {
    #[cfg(target_os = "linux")]
    {
        const MADV_POPULATE_WRITE: libc::c_int = 23;
        let mut p = at;
        while p < at + len {
            let n = POPULATE_PIECE.min(at + len - p);
            // SAFETY: advice about pages of the caller's own mapping.
            if unsafe { libc::madvise(p as *mut libc::c_void, n, MADV_POPULATE_WRITE) } != 0 {
                break;
            }
            p += n;
        }
        p - at
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (at, len);
        0
    }
}

impl AsRef<[u8]> for PageBuf {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

fn too_big(len: usize, why: &str) -> Error {
    Error::Io(std::io::Error::new(
        std::io::ErrorKind::OutOfMemory,
        format!("cannot map {len} bytes of staging memory: {why}"),
    ))
}

impl Drop for PageBuf {
    fn drop(&mut self) {
        if self.mapped > 0 {
            // SAFETY: the mapping made in `zeroed`, unmapped once; no slice of
            // it outlives `self`.
            unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.mapped) };
        }
    }
}

impl fmt::Debug for PageBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PageBuf({} bytes)", self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_zero_aligned_writable_and_exact() {
        for len in [0, 1, 4095, 4096, 4097, HUGE, HUGE + 3] {
            let mut b = PageBuf::zeroed(len).unwrap();
            assert_eq!(b.len(), len);
            assert!(b.as_slice().iter().all(|&x| x == 0), "{len} bytes are zero");
            if len > 0 {
                assert_eq!(b.as_slice().as_ptr() as usize % 4096, 0, "page-aligned");
                b.as_mut_slice()[len - 1] = 7;
                b.as_mut_slice()[0] = 9;
                let last = if len > 1 { 7 } else { 9 };
                assert_eq!((b.as_slice()[0], b.as_slice()[len - 1]), (9, last));
            }
        }
    }

    #[test]
    fn a_length_no_machine_can_map_is_a_typed_error() {
        let e = PageBuf::zeroed(usize::MAX / 2).unwrap_err();
        assert!(matches!(e, Error::Io(_)), "{e:?}");
        assert!(e.to_string().contains("staging memory"), "{e}");
    }
}
