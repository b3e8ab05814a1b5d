//! The zip container of `.pt` files: stored (uncompressed) entries, data aligned to
//! 64 bytes as `torch.save` aligns it, zip64 records, CRC-32 per entry.
//!
//! Both directions are pure: [`plan`] lays entries out and returns the parts to
//! upload (entry data is never copied) with each entry's data offset; [`parse`]
//! reads the central directory of a file in memory, size-capped, with checked
//! arithmetic, and refuses compressed or encrypted entries.

use bytes::Bytes;

use crate::error::CodecError;

/// Data of every entry starts at a multiple of this (what torch uses for mmap loads).
pub const ALIGN: u64 = 64;
/// Most entries a parsed archive may have.
pub const MAX_ENTRIES: u64 = 1 << 20;

const LOCAL_SIG: u32 = 0x0403_4b50;
const CENTRAL_SIG: u32 = 0x0201_4b50;
const EOCD_SIG: u32 = 0x0605_4b50;
const EOCD64_SIG: u32 = 0x0606_4b50;
const LOCATOR_SIG: u32 = 0x0706_4b50;
const ZIP64_EXTRA: u16 = 0x0001;
const PAD_EXTRA: u16 = 0x4246; // "FB", the id torch uses for its padding field
const U32_MAX: u64 = u32::MAX as u64;

/// One entry to write.
#[derive(Debug, Clone)]
pub struct Entry {
    /// Full name inside the archive (`archive/data/0`).
    pub name: String,
    /// The bytes.
    pub data: Bytes,
    /// CRC-32 of `data`.
    pub crc: u32,
}

/// A laid-out archive.
#[derive(Debug, Clone)]
pub struct Plan {
    /// The parts of the file, in order (headers are small owned buffers, data is shared).
    pub parts: Vec<Bytes>,
    /// File offset of each entry's data, in input order.
    pub data_offsets: Vec<u64>,
    /// Total file length.
    pub len: u64,
}

fn put16(v: &mut Vec<u8>, x: u16) {
    v.extend_from_slice(&x.to_le_bytes());
}
fn put32(v: &mut Vec<u8>, x: u32) {
    v.extend_from_slice(&x.to_le_bytes());
}
fn put64(v: &mut Vec<u8>, x: u64) {
    v.extend_from_slice(&x.to_le_bytes());
}
fn sat32(x: u64) -> u32 {
    x.min(U32_MAX) as u32
}

/// Lay out a stored zip archive.
pub fn plan(entries: &[Entry]) -> Result<Plan, CodecError> {
    let mut parts = Vec::with_capacity(entries.len() * 2 + 1);
    let mut offsets = Vec::with_capacity(entries.len());
    let mut central = Vec::new();
    let mut pos: u64 = 0;
    for e in entries {
        let name = e.name.as_bytes();
        let name_len =
            u16::try_from(name.len()).map_err(|_| CodecError::TooLarge("entry name".into()))?;
        let size = e.data.len() as u64;
        let big = size >= U32_MAX;
        let mut local = Vec::with_capacity(30 + name.len() + 84);
        put32(&mut local, LOCAL_SIG);
        put16(&mut local, if big { 45 } else { 20 });
        put16(&mut local, 0); // flags
        put16(&mut local, 0); // stored
        put32(&mut local, 0); // time, date
        put32(&mut local, e.crc);
        put32(&mut local, if big { u32::MAX } else { size as u32 });
        put32(&mut local, if big { u32::MAX } else { size as u32 });
        put16(&mut local, name_len);
        let zip64_len: u64 = if big { 20 } else { 0 };
        let before_pad = pos + 30 + name.len() as u64 + zip64_len + 4;
        let pad = (ALIGN - before_pad % ALIGN) % ALIGN;
        put16(&mut local, (zip64_len + 4 + pad) as u16);
        local.extend_from_slice(name);
        if big {
            put16(&mut local, ZIP64_EXTRA);
            put16(&mut local, 16);
            put64(&mut local, size);
            put64(&mut local, size);
        }
        put16(&mut local, PAD_EXTRA);
        put16(&mut local, pad as u16);
        local.resize(local.len() + pad as usize, 0);
        let header_at = pos;
        pos = pos
            .checked_add(local.len() as u64)
            .and_then(|p| p.checked_add(size))
            .ok_or_else(|| CodecError::TooLarge("archive".into()))?;
        offsets.push(header_at + local.len() as u64);
        parts.push(Bytes::from(local));
        if size > 0 {
            parts.push(e.data.clone());
        }

        // Central directory record; zip64 fields for whatever does not fit.
        let mut extra = Vec::new();
        if big {
            put64(&mut extra, size);
            put64(&mut extra, size);
        }
        if header_at >= U32_MAX {
            put64(&mut extra, header_at);
        }
        put32(&mut central, CENTRAL_SIG);
        put16(&mut central, 45);
        put16(&mut central, if extra.is_empty() { 20 } else { 45 });
        put16(&mut central, 0);
        put16(&mut central, 0);
        put32(&mut central, 0);
        put32(&mut central, e.crc);
        put32(&mut central, sat32(size));
        put32(&mut central, sat32(size));
        put16(&mut central, name_len);
        put16(
            &mut central,
            if extra.is_empty() {
                0
            } else {
                extra.len() as u16 + 4
            },
        );
        put16(&mut central, 0); // comment
        put16(&mut central, 0); // disk
        put16(&mut central, 0); // internal attributes
        put32(&mut central, 0); // external attributes
        put32(&mut central, sat32(header_at));
        central.extend_from_slice(name);
        if !extra.is_empty() {
            put16(&mut central, ZIP64_EXTRA);
            put16(&mut central, extra.len() as u16);
            central.extend_from_slice(&extra);
        }
    }
    let cd_offset = pos;
    let cd_size = central.len() as u64;
    let n = entries.len() as u64;
    let eocd64_at = cd_offset + cd_size;
    let mut tail = central;
    put32(&mut tail, EOCD64_SIG);
    put64(&mut tail, 44);
    put16(&mut tail, 45);
    put16(&mut tail, 45);
    put32(&mut tail, 0);
    put32(&mut tail, 0);
    put64(&mut tail, n);
    put64(&mut tail, n);
    put64(&mut tail, cd_size);
    put64(&mut tail, cd_offset);
    put32(&mut tail, LOCATOR_SIG);
    put32(&mut tail, 0);
    put64(&mut tail, eocd64_at);
    put32(&mut tail, 1);
    put32(&mut tail, EOCD_SIG);
    put32(&mut tail, 0);
    put16(&mut tail, n.min(0xFFFF) as u16);
    put16(&mut tail, n.min(0xFFFF) as u16);
    put32(&mut tail, sat32(cd_size));
    put32(&mut tail, sat32(cd_offset));
    put16(&mut tail, 0);
    let len = pos + tail.len() as u64;
    parts.push(Bytes::from(tail));
    Ok(Plan {
        parts,
        data_offsets: offsets,
        len,
    })
}

/// One entry of a parsed archive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    /// Full name.
    pub name: String,
    /// Offset of the data in the file.
    pub offset: usize,
    /// Length of the data.
    pub len: usize,
    /// CRC-32 recorded for the entry.
    pub crc: u32,
}

struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn new(b: &'a [u8], at: usize) -> Self {
        Cursor { b, at }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], CodecError> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len());
        let end =
            end.ok_or_else(|| CodecError::Truncated("zip structure runs past the end".into()))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u16(&mut self) -> Result<u16, CodecError> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }
    fn u32(&mut self) -> Result<u32, CodecError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64, CodecError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
}

fn usize_of(x: u64) -> Result<usize, CodecError> {
    usize::try_from(x).map_err(|_| CodecError::TooLarge(format!("zip field {x}")))
}

/// Parse the entries of a zip archive held in memory.
pub fn parse(file: &[u8]) -> Result<Vec<Found>, CodecError> {
    let bad = |s: &str| CodecError::Malformed(format!("zip: {s}"));
    if file.len() < 22 {
        return Err(CodecError::Truncated(
            "not a zip archive (too short)".into(),
        ));
    }
    let lo = file.len().saturating_sub(22 + 0xFFFF);
    let eocd = (lo..=file.len() - 22)
        .rev()
        .find(|&i| file[i..i + 4] == EOCD_SIG.to_le_bytes())
        .ok_or_else(|| bad("no end of central directory (not a zip archive?)"))?;
    let mut c = Cursor::new(file, eocd + 10);
    let mut count = c.u16()? as u64;
    let mut cd_size = c.u32()? as u64;
    let mut cd_offset = c.u32()? as u64;
    if eocd >= 20 && file[eocd - 20..eocd - 16] == LOCATOR_SIG.to_le_bytes() {
        let mut l = Cursor::new(file, eocd - 12);
        let at = usize_of(l.u64()?)?;
        let mut z = Cursor::new(file, at);
        if z.u32()? != EOCD64_SIG {
            return Err(bad("bad zip64 end record"));
        }
        z.take(20)?;
        count = z.u64()?;
        z.u64()?;
        cd_size = z.u64()?;
        cd_offset = z.u64()?;
    }
    if count > MAX_ENTRIES {
        return Err(CodecError::TooLarge(format!("{count} zip entries")));
    }
    let cd_end = cd_offset
        .checked_add(cd_size)
        .ok_or_else(|| bad("central directory overflows"))?;
    if cd_end > file.len() as u64 {
        return Err(CodecError::Truncated(
            "central directory runs past the end".into(),
        ));
    }
    let mut c = Cursor::new(file, usize_of(cd_offset)?);
    let mut out = Vec::with_capacity(count as usize);
    for _ in 0..count {
        if c.u32()? != CENTRAL_SIG {
            return Err(bad("bad central directory record"));
        }
        c.take(4)?;
        let flags = c.u16()?;
        let method = c.u16()?;
        c.take(4)?;
        let crc = c.u32()?;
        let mut comp = c.u32()? as u64;
        let mut size = c.u32()? as u64;
        let name_len = c.u16()? as usize;
        let extra_len = c.u16()? as usize;
        let comment_len = c.u16()? as usize;
        c.take(8)?;
        let mut local = c.u32()? as u64;
        let name = std::str::from_utf8(c.take(name_len)?)
            .map_err(|_| bad("entry name is not UTF-8"))?
            .to_owned();
        let mut extra = Cursor::new(c.take(extra_len)?, 0);
        while extra.b.len() - extra.at >= 4 {
            let id = extra.u16()?;
            let n = extra.u16()? as usize;
            let body = extra.take(n)?;
            if id == ZIP64_EXTRA {
                let mut z = Cursor::new(body, 0);
                if size == U32_MAX {
                    size = z.u64()?;
                }
                if comp == U32_MAX {
                    comp = z.u64()?;
                }
                if local == U32_MAX {
                    local = z.u64()?;
                }
            }
        }
        c.take(comment_len)?;
        if method != 0 || flags & 1 != 0 || comp != size {
            return Err(CodecError::Malformed(format!(
                "zip entry `{name}` is compressed or encrypted"
            )));
        }
        let mut l = Cursor::new(file, usize_of(local)?);
        if l.u32()? != LOCAL_SIG {
            return Err(bad("bad local header"));
        }
        l.take(22)?;
        let n = l.u16()? as usize;
        let m = l.u16()? as usize;
        l.take(n)?;
        l.take(m)?;
        let offset = l.at;
        let len = usize_of(size)?;
        l.take(len)?;
        out.push(Found {
            name,
            offset,
            len,
            crc,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, data: &[u8]) -> Entry {
        Entry {
            name: name.into(),
            data: Bytes::copy_from_slice(data),
            crc: crc32fast::hash(data),
        }
    }

    #[test]
    fn plan_then_parse_finds_aligned_data() {
        let es = vec![
            entry("a/data.pkl", b"hello"),
            entry("a/data/0", &[]),
            entry("a/data/1", &[7u8; 100]),
        ];
        let p = plan(&es).unwrap();
        let file: Vec<u8> = p.parts.iter().flat_map(|b| b.iter().copied()).collect();
        assert_eq!(file.len() as u64, p.len);
        let found = parse(&file).unwrap();
        assert_eq!(found.len(), 3);
        for ((f, e), off) in found.iter().zip(&es).zip(&p.data_offsets) {
            assert_eq!(f.name, e.name);
            assert_eq!(f.offset as u64, *off);
            assert_eq!(off % ALIGN, 0);
            assert_eq!(&file[f.offset..f.offset + f.len], &e.data[..]);
            assert_eq!(f.crc, e.crc);
        }
    }

    #[test]
    fn damaged_archives_are_errors_not_panics() {
        let p = plan(&[entry("x/y", b"0123456789")]).unwrap();
        let file: Vec<u8> = p.parts.iter().flat_map(|b| b.iter().copied()).collect();
        for cut in 0..file.len() {
            let _ = parse(&file[..cut]);
        }
        for i in 0..file.len() {
            let mut f = file.clone();
            f[i] ^= 0xFF;
            let _ = parse(&f);
        }
        assert!(parse(b"not a zip at all, not at all").is_err());
    }
}
