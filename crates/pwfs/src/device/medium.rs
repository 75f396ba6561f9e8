//! Media: where the bytes live, apart from how requests reach them (the engines).
//!
//! - [`FileMedium`]: an image file or a block device, reached through its descriptor
//!   (positioned reads and writes, fdatasync). The io_uring and psync engines issue
//!   requests to it; the engines that issue I/O asynchronously hold it in an `Arc`, so
//!   that the descriptor stays open while requests on it are in flight.
//! - [`MemoryMedium`]: bytes in memory, reached with loads and stores, made durable by
//!   [`MemoryMedium::persist`]. The mem and sim engines work on it. Today it is heap
//!   memory, where `persist` has nothing to do; a pmem medium is this with the bytes in
//!   a mapping of a DAX (or tmpfs) file and `persist` writing back the cache lines of the
//!   range (clwb, then sfence).

use super::{Op, SECTOR};
use parking_lot::RwLock;
use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::{AsRawFd, RawFd};
use std::path::Path;

/// An advisory lock on an image (flock), taken without waiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lock {
    None,
    /// Readers (fsck, info): refused while a writer holds the image.
    Shared,
    /// A mount or mkfs: refused while anyone else holds the image.
    Exclusive,
}

/// Take `lock` on an open image (flock). A lock held a moment after its holder is gone
/// is let go of: the kernel drops an exited process's io_uring (and the image file it
/// refers to) asynchronously, and a child between fork and exec holds a copy of every
/// descriptor. Only a lock that stays held for a second means "in use" (WouldBlock).
pub fn lock_file(file: &File, lock: Lock) -> std::io::Result<()> {
    let how = match lock {
        Lock::None => return Ok(()),
        Lock::Shared => libc::LOCK_SH,
        Lock::Exclusive => libc::LOCK_EX,
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(1);
    loop {
        // SAFETY: plain syscall on an fd the caller owns; the lock lives as long as the file.
        if unsafe { libc::flock(file.as_raw_fd(), how | libc::LOCK_NB) } == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(e);
        }
        if std::time::Instant::now() >= deadline {
            return Err(std::io::Error::new(
                std::io::ErrorKind::WouldBlock,
                "the image is in use by another pwfs process (mounted, or being checked)",
            ));
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// An image file or a block device.
pub struct FileMedium {
    file: File,
    /// Usable bytes: a multiple of SECTOR.
    len: u64,
}

impl FileMedium {
    /// Open `path` for reading and writing, with O_DIRECT if `direct`, holding `lock`.
    pub fn open(path: &Path, direct: bool, lock: Lock) -> std::io::Result<FileMedium> {
        use std::os::unix::fs::FileTypeExt;
        let mut o = OpenOptions::new();
        o.read(true).write(true);
        let mut flags = if direct { libc::O_DIRECT } else { 0 };
        // A block device is also held exclusively against everything else that opens
        // it so (a mounted file system, another mkfs): flock only sees pwfs.
        if lock == Lock::Exclusive && std::fs::metadata(path).is_ok_and(|m| m.file_type().is_block_device()) {
            flags |= libc::O_EXCL;
        }
        o.custom_flags(flags);
        let mut file = o.open(path)?;
        lock_file(&file, lock)?;
        let len = file.seek(SeekFrom::End(0))?;
        Ok(FileMedium::new(file, len))
    }

    /// Wrap an open file or block device; `len` is its usable size in bytes.
    pub fn new(file: File, len: u64) -> FileMedium {
        FileMedium { file, len: len - len % SECTOR }
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }
}

/// Bytes in memory: loads and stores, and `persist` to make stores durable.
pub struct MemoryMedium {
    bytes: RwLock<Vec<u8>>,
}

impl MemoryMedium {
    pub fn new(bytes: Vec<u8>) -> MemoryMedium {
        MemoryMedium { bytes: RwLock::new(bytes) }
    }

    pub fn len(&self) -> u64 {
        self.bytes.read().len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copy a validated read op's bytes out of the medium.
    pub fn load(&self, op: &mut Op) {
        let image = self.bytes.read();
        let mut at = op.offset as usize;
        for b in op.bufs.iter_mut() {
            let n = b.len();
            b.copy_from_slice(&image[at..at + n]);
            at += n;
        }
    }

    /// Copy a validated write op's bytes into the medium.
    pub fn store(&self, op: &Op) {
        let mut image = self.bytes.write();
        let mut at = op.offset as usize;
        for b in op.bufs.iter() {
            image[at..at + b.len()].copy_from_slice(b);
            at += b.len();
        }
    }

    /// Make the stores to `len` bytes at `offset` durable. Heap memory does not survive
    /// the process whatever is done, so there is nothing to do; a pmem medium writes
    /// back the range's cache lines here.
    pub fn persist(&self, offset: u64, len: u64) {
        debug_assert!(offset.checked_add(len).is_some_and(|end| end <= self.len()));
    }

    /// A copy of every byte.
    pub fn snapshot(&self) -> Vec<u8> {
        self.bytes.read().clone()
    }
}
