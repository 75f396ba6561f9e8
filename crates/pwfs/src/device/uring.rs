//! io_uring engine: O_DIRECT, registered (fixed) buffers, one ring per thread, a
//! bounded number of I/Os in flight, no merging and no scheduling of our own.
//!
//! Each device owns an [`Arena`] of block-sized slots. A thread's first request on a
//! device creates that thread's ring and registers the whole arena as fixed buffer 0,
//! so that page-cache buffers taken from the arena go through READ_FIXED/WRITE_FIXED
//! without per-request page pinning. Other buffers use plain or vectored ops.

use super::psync::complete;
use super::{validate, AlignedBuf, Arena, DevError, Device, Done, Op, OpKind, SECTOR};
use io_uring::{opcode, types, IoUring};
use std::cell::RefCell;
use std::fs::{File, OpenOptions};
use std::io::{Seek, SeekFrom};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

struct Ring {
    device: u64,
    /// Streams (`submit_stream`) have a ring of their own, so that I/O the stream's
    /// producer does on the same thread never reaps the stream's completions.
    stream: bool,
    arena: Weak<Arena>,
    ring: IoUring,
    /// The arena is registered as fixed buffer 0.
    fixed: bool,
    /// The kernel has READV_FIXED/WRITEV_FIXED (6.15+): vectored ops skip page pinning.
    vec_fixed: bool,
}

thread_local! {
    static RINGS: RefCell<Vec<Ring>> = const { RefCell::new(Vec::new()) };
}

pub struct UringDevice {
    file: File,
    len: u64,
    id: u64,
    arena: Arc<Arena>,
    depth: u32,
}

#[derive(Debug, Clone)]
pub struct UringOptions {
    /// Bytes of registered buffer memory (block-sized slots).
    pub arena_bytes: usize,
    /// Maximum I/Os in flight per ring.
    pub queue_depth: u32,
    /// Open with O_DIRECT (bypass the kernel page cache).
    pub direct: bool,
    /// Advisory lock on the image (flock), taken without waiting.
    pub lock: Lock,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lock {
    None,
    /// Readers (fsck, info): refused while a writer holds the image.
    Shared,
    /// A mount or mkfs: refused while anyone else holds the image.
    Exclusive,
}

impl Default for UringOptions {
    fn default() -> Self {
        UringOptions { arena_bytes: 64 << 20, queue_depth: 64, direct: true, lock: Lock::None }
    }
}

impl UringDevice {
    pub fn open(path: &Path, opts: &UringOptions) -> std::io::Result<UringDevice> {
        let mut o = OpenOptions::new();
        o.read(true).write(true);
        if opts.direct {
            o.custom_flags(libc::O_DIRECT);
        }
        let mut file = o.open(path)?;
        let how = match opts.lock {
            Lock::None => None,
            Lock::Shared => Some(libc::LOCK_SH),
            Lock::Exclusive => Some(libc::LOCK_EX),
        };
        if let Some(how) = how {
            // SAFETY: plain syscall on an fd we own; the lock lives as long as the file.
            if unsafe { libc::flock(file.as_raw_fd(), how | libc::LOCK_NB) } != 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::WouldBlock,
                        "the image is in use by another pwfs process (mounted, or being checked)",
                    ));
                }
                return Err(e);
            }
        }
        let len = file.seek(SeekFrom::End(0))?;
        UringDevice::from_file(file, len, opts)
    }

    pub fn from_file(file: File, len: u64, opts: &UringOptions) -> std::io::Result<UringDevice> {
        let slots = (opts.arena_bytes / 4096).max(16);
        // Probe that io_uring works here at all, so that open fails cleanly rather than
        // the first request.
        IoUring::new(2)?;
        Ok(UringDevice {
            file,
            len: len - len % SECTOR,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            arena: Arena::new(4096, slots)?,
            depth: opts.queue_depth.clamp(1, 4096),
        })
    }

    fn with_ring<R>(&self, f: impl FnOnce(&mut Ring) -> R) -> R {
        self.with_ring_of(false, f)
    }

    fn with_ring_of<R>(&self, stream: bool, f: impl FnOnce(&mut Ring) -> R) -> R {
        RINGS.with(|rings| {
            let mut rings = rings.borrow_mut();
            if let Some(r) = rings.iter_mut().find(|r| r.device == self.id && r.stream == stream) {
                return f(r);
            }
            // Drop rings of devices that are gone before adding one.
            rings.retain(|r| r.arena.strong_count() > 0);
            let ring = IoUring::new(self.depth.next_power_of_two()).expect("io_uring_setup");
            let iov = libc::iovec { iov_base: self.arena.base() as *mut libc::c_void, iov_len: self.arena.bytes() };
            // SAFETY: the arena outlives every use of the registration: a ring is only
            // used through `self`, which holds the arena, and is pruned once it is gone.
            let fixed = unsafe { ring.submitter().register_buffers(&[iov]) }.is_ok();
            let mut probe = io_uring::Probe::new();
            let vec_fixed = fixed
                && ring.submitter().register_probe(&mut probe).is_ok()
                && probe.is_supported(opcode::ReadvFixed::CODE)
                && probe.is_supported(opcode::WritevFixed::CODE);
            rings.push(Ring { device: self.id, stream, arena: Arc::downgrade(&self.arena), ring, fixed, vec_fixed });
            f(rings.last_mut().expect("just pushed"))
        })
    }

    /// The engine: ops from `next` go on the ring as room allows; `next` is asked for
    /// more only while the ring has room and everything so far is submitted, and runs
    /// outside the ring's borrow (it may do I/O of its own, on the other ring).
    fn run(&self, stream: bool, next: &mut dyn FnMut() -> Option<Vec<Op>>) -> Vec<Done> {
        let mut ops: Vec<Op> = Vec::new();
        let mut results: Vec<Option<Result<(), DevError>>> = Vec::new();
        // Heap storage of each op's iovecs stays put while `iovs` grows.
        let mut iovs: Vec<Vec<libc::iovec>> = Vec::new();
        let (mut pushed, mut in_flight, mut exhausted) = (0usize, 0u32, false);
        loop {
            // Ask for more work only when everything so far is on the device and there
            // is room; the producer runs (and may do I/O of its own) outside the ring.
            if !exhausted && pushed == ops.len() && in_flight < self.depth {
                match next() {
                    Some(batch) => {
                        for op in batch {
                            results.push(validate(&op, self.len).err().map(Err));
                            iovs.push(Vec::new());
                            ops.push(op);
                        }
                    }
                    None => exhausted = true,
                }
            }
            let finished = self.with_ring_of(stream, |r| {
                while pushed < ops.len() && in_flight < self.depth {
                    if results[pushed].is_none() {
                        let e = self
                            .entry(&mut ops[pushed], &mut iovs[pushed], r.fixed, r.vec_fixed)
                            .user_data(pushed as u64);
                        // SAFETY: buffers and iovecs stay alive and unmoved until the
                        // completion for this entry is reaped.
                        if unsafe { r.ring.submission().push(&e) }.is_err() {
                            break;
                        }
                        in_flight += 1;
                    }
                    pushed += 1;
                }
                if in_flight == 0 {
                    return exhausted && pushed == ops.len();
                }
                // Start the I/O; wait for a completion only if there is nothing else
                // to do (no more work to ask for, or no room for it).
                let more = !exhausted && pushed == ops.len() && in_flight < self.depth;
                loop {
                    match r.ring.submit_and_wait(if more { 0 } else { 1 }) {
                        Ok(_) => break,
                        Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) => {
                            continue
                        }
                        // The ring itself is broken: nothing here can recover the I/O in flight.
                        Err(e) => panic!("io_uring_enter failed: {e}"),
                    }
                }
                for cqe in r.ring.completion() {
                    let i = cqe.user_data() as usize;
                    let res = cqe.result();
                    results[i] =
                        Some(if res < 0 { Err(DevError::Io(-res)) } else { complete(res as i64, ops[i].len()) });
                    in_flight -= 1;
                }
                false
            });
            if finished {
                break;
            }
        }
        ops.into_iter()
            .zip(results)
            .map(|(op, r)| Done { bufs: op.bufs, result: r.expect("every op completed") })
            .collect()
    }

    fn entry(&self, op: &mut Op, iovs: &mut Vec<libc::iovec>, fixed: bool, vec_fixed: bool) -> io_uring::squeue::Entry {
        let fd = types::Fd(self.file.as_raw_fd());
        if op.bufs.len() == 1 {
            let own = op.bufs[0].arena().is_some_and(|a| Arc::ptr_eq(a, &self.arena));
            let b = &mut op.bufs[0];
            let (ptr, len) = (b.as_mut_ptr(), b.len() as u32);
            return match (op.kind, own && fixed) {
                (OpKind::Read, true) => opcode::ReadFixed::new(fd, ptr, len, 0).offset(op.offset).build(),
                (OpKind::Write, true) => opcode::WriteFixed::new(fd, ptr, len, 0).offset(op.offset).build(),
                (OpKind::Read, false) => opcode::Read::new(fd, ptr, len).offset(op.offset).build(),
                (OpKind::Write, false) => opcode::Write::new(fd, ptr, len).offset(op.offset).build(),
            };
        }
        *iovs = op
            .bufs
            .iter_mut()
            .map(|b| libc::iovec { iov_base: b.as_mut_ptr() as *mut libc::c_void, iov_len: b.len() })
            .collect();
        // All buffers in the registered arena: the kernel need not pin their pages.
        let fixed_vec = vec_fixed && op.bufs.iter().all(|b| b.arena().is_some_and(|a| Arc::ptr_eq(a, &self.arena)));
        let (ptr, n) = (iovs.as_ptr(), iovs.len() as u32);
        match (op.kind, fixed_vec) {
            (OpKind::Read, true) => opcode::ReadvFixed::new(fd, ptr, n, 0).offset(op.offset).build(),
            (OpKind::Write, true) => opcode::WritevFixed::new(fd, ptr, n, 0).offset(op.offset).build(),
            (OpKind::Read, false) => opcode::Readv::new(fd, ptr, n).offset(op.offset).build(),
            (OpKind::Write, false) => opcode::Writev::new(fd, ptr, n).offset(op.offset).build(),
        }
    }
}

impl Device for UringDevice {
    fn len(&self) -> u64 {
        self.len
    }

    fn alloc(&self, len: usize) -> AlignedBuf {
        self.arena.alloc(len).unwrap_or_else(|| AlignedBuf::new(len))
    }

    fn submit(&self, ops: Vec<Op>) -> Vec<Done> {
        let mut once = Some(ops);
        self.run(false, &mut || once.take())
    }

    fn submit_stream(&self, next: &mut dyn FnMut() -> Option<Vec<Op>>) -> Vec<Done> {
        self.run(true, next)
    }

    fn flush(&self) -> Result<(), DevError> {
        self.with_ring(|r| {
            let fd = types::Fd(self.file.as_raw_fd());
            let e = opcode::Fsync::new(fd).flags(types::FsyncFlags::DATASYNC).build().user_data(u64::MAX);
            // SAFETY: the entry references no memory.
            unsafe { r.ring.submission().push(&e) }.map_err(|_| DevError::Io(libc::EBUSY))?;
            loop {
                match r.ring.submit_and_wait(1) {
                    Ok(_) => break,
                    Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                    Err(e) => return Err(DevError::Io(e.raw_os_error().unwrap_or(libc::EIO))),
                }
            }
            let cqe = r.ring.completion().next().expect("flush completion");
            if cqe.result() < 0 {
                return Err(DevError::Io(-cqe.result()));
            }
            Ok(())
        })
    }

    fn name(&self) -> &'static str {
        "uring"
    }
}
