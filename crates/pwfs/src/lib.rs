//! Patchwork (`pwfs`): a user-space file system and I/O stack.
//!
//! Layers, top to bottom (DESIGN.md §2); a module uses only the ones below it, and
//! each mechanism is one module named after it:
//! - [`fs`]: namespace, inodes, directories, file I/O entry points, mkfs and mount,
//!   the Rust API.
//! - `lock` (file access ordering; range locks of mechanism 2 plug in here), `cache`
//!   (page states, sharded CLOCK) with `nbw` (mechanism 1: patches, fetch policies,
//!   the fetcher) and `readahead`; `commit` (admitting operations into the running
//!   transaction, closing and logging it) over `journal` (records, commit, recovery);
//!   `writeback` (placing and writing dirty pages, pressure, the background thread)
//!   with `hitchhike` (mechanism 3: small synchronous writes carried as deltas in
//!   the commit block).
//! - `alloc` (free space) and [`format`](crate::format) (every on-disk structure).
//! - [`device`] (io_uring, pread/pwrite, memory, simulated engines).
//!
//! [`fsck`] reads an image with `format` and `journal` (and the superblock reader of
//! `fs`), never through a mounted file system, so that it checks what is on the medium.
//! Modules below `fs` are private to the crate; what front ends may use is re-exported.

mod aios;
mod alloc;
mod cache;
mod commit;
pub mod config;
pub mod device;
pub mod error;
pub mod format;
pub mod fs;
pub mod fsck;
mod hitchhike;
mod journal;
mod lock;
mod nbw;
mod readahead;
mod writeback;

pub use aios::{IoTimes, PathTimes};
pub use hitchhike::HitchhikeStats;
pub use journal::{DeltaCounts, JournalStats};

pub use config::{Config, FetchPolicy, IoPath, LockMode, MountCheck, Stack};
pub use error::{Error, ErrorKind, Result};
pub use fs::api::TimeSet;
pub use fs::{
    mkfs, Creator, DirEntry, File, FileType, Fs, GoingDown, Metadata, MkfsOptions, MountReport, OpenOptions,
    PrivChange, SetAttr, StatFs,
};

use device::uring::{Lock, UringDevice, UringOptions};
use std::path::Path;
use std::sync::Arc;

/// The io_uring engine's options for `config`: registered buffer memory for the
/// cache's pages plus 32 MiB for metadata blocks and journal images in flight (write-
/// back lends the pages' own buffers, no copies); buffers beyond it come from the heap
/// and go through unregistered requests. The arena is pinned when it is registered, so
/// it is what an idle daemon holds: its cache plus 32 MiB (it held twice its cache
/// before). The image is locked exclusively for writing, shared for a read-only
/// `config`.
pub fn device_options(config: &Config) -> UringOptions {
    UringOptions {
        arena_bytes: config.cache_bytes as usize + (32 << 20),
        lock: if config.read_only { Lock::Shared } else { Lock::Exclusive },
        poll: config.poll,
        ..Default::default()
    }
}

/// Open an image file or block device with the io_uring engine, sized for `config`:
/// locked exclusively for writing, shared for a read-only `config`.
pub fn open_device(path: &Path, config: &Config) -> Result<Arc<dyn device::Device>> {
    let opts = device_options(config);
    let dev = UringDevice::open(path, &opts).map_err(|e| {
        let what = format!("cannot open {}: {e}", path.display());
        // In use (another pwfs holds its lock, or a block device is open exclusively
        // elsewhere): EBUSY, as mount(2) says.
        match (e.kind(), e.raw_os_error()) {
            (std::io::ErrorKind::WouldBlock, _) | (_, Some(libc::EBUSY)) => Error::new(ErrorKind::Busy, what),
            _ => Error::io(what),
        }
    })?;
    Ok(Arc::new(dev))
}

/// Create (or reuse) an image file of `size` bytes, allocated up front so that
/// O_DIRECT writes never wait on the host file system, and format it.
pub fn mkfs_image(path: &Path, size: u64, opts: &MkfsOptions) -> Result<format::Superblock> {
    mkfs_image_with_progress(path, size, opts, &mut |_, _| {})
}

/// [`mkfs_image`], calling `progress(done, total)` as it formats (see
/// [`fs::mkfs_with_progress`]).
pub fn mkfs_image_with_progress(
    path: &Path,
    size: u64,
    opts: &MkfsOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<format::Superblock> {
    use std::os::unix::fs::OpenOptionsExt;
    use std::os::unix::io::AsRawFd;
    let size = size - size % format::BLOCK;
    if size < 64 * format::BLOCK {
        return Err(Error::invalid(format!("an image needs at least 256 KiB, not {size} bytes")));
    }
    // A new image is its owner's only: it holds every file, whatever their modes say.
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
        .map_err(|e| Error::io(format!("cannot create {}: {e}", path.display())))?;
    let meta = file.metadata().map_err(|e| Error::io(e.to_string()))?;
    if meta.file_type().is_file() {
        // An image in use (mounted) is refused before anything changes it: sizing it
        // first cut a mounted image short, and the mount then wrote into a file that
        // no longer held its blocks.
        device::medium::lock_file(&file, device::medium::Lock::Exclusive)
            .map_err(|e| Error::new(ErrorKind::Busy, format!("cannot format {}: {e}", path.display())))?;
        file.set_len(size).map_err(|e| Error::io(format!("cannot size {}: {e}", path.display())))?;
        // SAFETY: plain syscall on an fd we own.
        let r = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, size as i64) };
        if r != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENOSPC) {
                return Err(Error::no_space(format!("cannot allocate {size} bytes for {}", path.display())));
            }
        }
    }
    drop(file);
    let dev = open_device(path, &Config { cache_bytes: 1 << 20, ..Default::default() })?;
    fs::mkfs_with_progress(&*dev, opts, progress)
}

/// Mount an image file or block device with the io_uring engine.
pub fn mount_image(path: &Path, config: Config) -> Result<Fs> {
    let dev = open_device(path, &config)?;
    Fs::mount(dev, config)
}
