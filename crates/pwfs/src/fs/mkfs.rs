//! mkfs: lay out and format a device; read and check its superblock.

use super::meta;
use crate::device::{AlignedBuf, Device, Op, OpKind};
use crate::error::{Error, Result};
use crate::format::{self as f, Superblock, BLOCK, BLOCK_SIZE};
use crate::journal;

/// Options for formatting a device.
#[derive(Debug, Clone, Default)]
pub struct MkfsOptions {
    /// Number of inodes (default: one per 16 KiB, at least 1024).
    pub inodes: Option<u64>,
    /// Journal size in blocks (default: 1/64 of the device, 256..=16384 blocks).
    pub journal_blocks: Option<u64>,
}

fn now_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

/// Format `dev`. Everything on it is lost.
pub fn mkfs(dev: &dyn Device, opts: &MkfsOptions) -> Result<Superblock> {
    let total = dev.len() / BLOCK;
    if total < 64 {
        return Err(Error::invalid(format!("device too small: {} bytes (need at least 256 KiB)", dev.len())));
    }
    let inodes = opts.inodes.unwrap_or((total / 4).max(1024)).min(u32::MAX as u64);
    // The log must hold the largest single operation: a truncate or delete that
    // changes every block-bitmap block, plus a few inode and directory blocks.
    let min_journal = total.div_ceil(f::BITS_PER_BITMAP_BLOCK) + 32;
    let jblocks = match opts.journal_blocks {
        Some(n) if n < min_journal => {
            return Err(Error::invalid(format!(
                "a journal of {n} blocks is too small for {total} blocks: it needs at least {min_journal}"
            )))
        }
        Some(n) => n.min(total / 4).max(16),
        None => (total / 64).clamp(256, 16384).max(min_journal).min(total / 4).max(16),
    };
    let mut uuid = [0u8; 16];
    rand::Rng::fill(&mut rand::thread_rng(), &mut uuid[..]);
    let sb = Superblock::layout(total, inodes, jblocks, uuid, now_ns())
        .map_err(|e| Error::invalid(format!("cannot lay out a file system on {total} blocks: {e}")))?;
    let write = |block: u64, bufs: Vec<AlignedBuf>| -> Result<()> {
        for d in dev.submit(vec![Op { kind: OpKind::Write, offset: block * BLOCK, bufs }]) {
            d.result?;
        }
        Ok(())
    };
    let zeros = |n: u64| (0..n).map(|_| dev.alloc_zeroed(BLOCK_SIZE)).collect::<Vec<_>>();
    // Inode table and the first log block: zeroed, so nothing of an earlier format is read.
    let mut b = sb.inode_table_start;
    while b < sb.data_start {
        let n = (sb.data_start - b).min(256);
        write(b, zeros(n))?;
        b += n;
    }
    write(sb.journal_start + 1, zeros(1))?;
    // Block bitmap: everything outside the data area is in use.
    for i in 0..sb.block_bitmap_blocks {
        let mut buf = dev.alloc_zeroed(BLOCK_SIZE);
        for bit in 0..f::BITS_PER_BITMAP_BLOCK {
            let blk = i * f::BITS_PER_BITMAP_BLOCK + bit;
            if blk < sb.data_start || (blk >= sb.data_end && blk < total) {
                buf[(bit / 8) as usize] |= 1 << (bit % 8);
            }
        }
        f::bitmap_seal(&mut buf, i);
        write(sb.block_bitmap_start + i, vec![buf])?;
    }
    for i in 0..sb.inode_bitmap_blocks {
        let mut buf = dev.alloc_zeroed(BLOCK_SIZE);
        if i == 0 {
            buf[0] = 1; // the root inode
        }
        f::bitmap_seal(&mut buf, i);
        write(sb.inode_bitmap_start + i, vec![buf])?;
    }
    let t = meta::now();
    let root = f::DiskInode {
        mode: f::S_IFDIR | 0o755,
        nlink: 2,
        parent: f::ROOT_INO,
        atime: t,
        mtime: t,
        ctime: t,
        generation: 1,
        ..Default::default()
    };
    let mut buf = dev.alloc_zeroed(BLOCK_SIZE);
    root.encode(f::ROOT_INO, &mut buf[..f::INODE_SIZE]);
    write(sb.inode_table_start, vec![buf])?;
    // A start sequence nobody used before on this medium, so stale log blocks never match.
    let start_seq = (rand::random::<u32>() as u64) << 20 | 1;
    journal::write_header(dev, sb.journal_start, start_seq)?;
    let mut buf = dev.alloc(BLOCK_SIZE);
    sb.encode(&mut buf);
    let backup = AlignedBuf::from_slice(&buf);
    write(total - 1, vec![backup])?;
    dev.flush()?;
    // The primary superblock last: until it is written the device is not a pwfs image.
    write(0, vec![buf])?;
    dev.flush()?;
    Ok(sb)
}

/// Read and check the superblock, falling back to the backup copy.
pub fn read_superblock(dev: &dyn Device) -> Result<(Superblock, bool)> {
    let total = dev.len() / BLOCK;
    if total < 64 {
        return Err(Error::corrupt(format!("device too small to hold a pwfs image ({} bytes)", dev.len())));
    }
    let read = |b: u64| -> Result<AlignedBuf> {
        let (buf, r) = dev.read(b * BLOCK, dev.alloc(BLOCK_SIZE));
        r?;
        Ok(buf)
    };
    let (sb, backup) = match Superblock::decode(&read(0)?) {
        Ok(sb) => (sb, false),
        Err(primary) => match Superblock::decode(&read(total - 1)?) {
            Ok(sb) if !matches!(primary, f::FormatError::Magic { .. }) => (sb, true),
            _ => {
                return Err(Error::corrupt(match primary {
                    f::FormatError::Magic { .. } => "not a pwfs image (no superblock magic)".to_string(),
                    e => format!("bad superblock and no usable backup: {e}"),
                }))
            }
        },
    };
    if sb.total_blocks > total {
        return Err(Error::corrupt(format!(
            "image truncated: superblock says {} blocks, device has {total}",
            sb.total_blocks
        )));
    }
    Ok((sb, backup))
}
