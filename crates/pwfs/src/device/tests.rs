//! One conformance suite, run against every engine.

use super::mem::MemDevice;
use super::psync::PsyncDevice;
use super::sim::{crash_image, LogEntry, SimConfig, SimDevice};
use super::uring::{UringDevice, UringOptions};
use super::*;

const LEN: u64 = 1 << 20;

fn pattern(len: usize, seed: u8) -> AlignedBuf {
    let mut b = AlignedBuf::new(len);
    for (i, x) in b.iter_mut().enumerate() {
        *x = (i as u8).wrapping_mul(31).wrapping_add(seed);
    }
    b
}

fn image_file(len: u64) -> (tempdir::Dir, std::path::PathBuf) {
    let d = tempdir::Dir::new();
    let p = d.path().join("dev.img");
    let f = std::fs::File::create(&p).unwrap();
    f.set_len(len).unwrap();
    (d, p)
}

/// A minimal self-cleaning temporary directory (no extra crate needed for tests).
pub(crate) mod tempdir {
    pub struct Dir(std::path::PathBuf);
    impl Dir {
        pub fn new() -> Dir {
            use std::sync::atomic::{AtomicU64, Ordering};
            static N: AtomicU64 = AtomicU64::new(0);
            let p = std::env::temp_dir().join(format!(
                "pwfs-test-{}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir_all(&p).unwrap();
            Dir(p)
        }
        pub fn path(&self) -> &std::path::Path {
            &self.0
        }
    }
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fn conformance(dev: &dyn Device) {
    assert_eq!(dev.len(), LEN);
    // Round trip of single and vectored ops, fixed-buffer memory included.
    let (_, r) = dev.write(8192, pattern(4096, 1));
    r.unwrap();
    let mut arena_buf = dev.alloc(4096);
    arena_buf.copy_from_slice(&pattern(4096, 2));
    let (_, r) = dev.write(4096, arena_buf);
    r.unwrap();
    let done =
        dev.submit(vec![Op { kind: OpKind::Write, offset: 16384, bufs: vec![pattern(4096, 3), pattern(512, 4)] }]);
    done[0].result.clone().unwrap();
    assert_eq!(done[0].bufs.len(), 2, "vectored op hands every buffer back");
    dev.flush().unwrap();
    let (b, r) = dev.read(8192, dev.alloc(4096));
    r.unwrap();
    assert_eq!(&b[..], &pattern(4096, 1)[..]);
    let (b, r) = dev.read(4096, AlignedBuf::new(4096));
    r.unwrap();
    assert_eq!(&b[..], &pattern(4096, 2)[..]);
    let done = dev.submit(vec![Op {
        kind: OpKind::Read,
        offset: 16384,
        bufs: vec![AlignedBuf::new(4096), AlignedBuf::new(512)],
    }]);
    done[0].result.clone().unwrap();
    assert_eq!(&done[0].bufs[0][..], &pattern(4096, 3)[..]);
    assert_eq!(&done[0].bufs[1][..], &pattern(512, 4)[..]);
    // Sector-granular writes are accepted.
    let (_, r) = dev.write(512, pattern(512, 5));
    r.unwrap();

    // Misalignment is rejected, and the buffer comes back.
    let (b, r) = dev.read(100, AlignedBuf::new(512));
    assert_eq!(r, Err(DevError::Misaligned));
    assert_eq!(b.len(), 512);
    let (_, r) = dev.write(0, AlignedBuf::new(100));
    assert_eq!(r, Err(DevError::Misaligned));
    // Past the end: out of range, never a short success.
    let (_, r) = dev.read(LEN - 512, AlignedBuf::new(4096));
    assert_eq!(r, Err(DevError::OutOfRange));
    let (_, r) = dev.write(LEN, AlignedBuf::new(512));
    assert_eq!(r, Err(DevError::OutOfRange));

    // A batch larger than any queue depth completes in order of the ops given.
    let ops: Vec<Op> = (0..200).map(|i| Op::write(65536 + i * 4096, pattern(4096, i as u8))).collect();
    for d in dev.submit(ops) {
        d.result.unwrap();
    }
    let ops: Vec<Op> = (0..200).map(|i| Op::read(65536 + i * 4096, dev.alloc(4096))).collect();
    for (i, d) in dev.submit(ops).into_iter().enumerate() {
        d.result.unwrap();
        assert_eq!(&d.bufs[0][..], &pattern(4096, i as u8)[..]);
    }
    // A stream: batches produced while earlier ones are in flight, results in order,
    // and the producer may do I/O of its own on the same device meanwhile.
    let mut batch = 0u64;
    let mut next = || {
        if batch == 8 {
            return None;
        }
        let (_, r) = dev.read(0, dev.alloc(512));
        r.unwrap();
        let ops = (0..40)
            .map(|i| Op::write(65536 + (batch * 40 + i) * 1024, pattern(1024, (batch * 40 + i) as u8)))
            .collect();
        batch += 1;
        Some(ops)
    };
    let done = dev.submit_stream(&mut next);
    assert_eq!(done.len(), 320);
    for d in &done {
        d.result.clone().unwrap();
    }
    for i in 0..320u64 {
        let (b, r) = dev.read(65536 + i * 1024, AlignedBuf::new(1024));
        r.unwrap();
        assert_eq!(&b[..], &pattern(1024, i as u8)[..], "stream write {i}");
    }
    let mut once = Some(vec![Op::read(7, AlignedBuf::new(512)), Op::read(0, AlignedBuf::new(512))]);
    let done = dev.submit_stream(&mut || once.take());
    assert_eq!(done[0].result, Err(DevError::Misaligned));
    assert!(done[1].result.is_ok());
    // Errors in a batch stay with their op.
    let done = dev.submit(vec![Op::read(0, AlignedBuf::new(512)), Op::read(7, AlignedBuf::new(512))]);
    assert!(done[0].result.is_ok());
    assert_eq!(done[1].result, Err(DevError::Misaligned));
}

#[test]
fn mem_engine_conforms() {
    conformance(&MemDevice::new(LEN));
}

#[test]
fn sim_engine_conforms() {
    conformance(&SimDevice::new(vec![0; LEN as usize], SimConfig::default()));
}

#[test]
fn psync_engine_conforms() {
    let (_d, p) = image_file(LEN);
    let f = std::fs::OpenOptions::new().read(true).write(true).open(&p).unwrap();
    conformance(&PsyncDevice::new(f, LEN));
}

#[test]
fn uring_engine_conforms() {
    let (_d, p) = image_file(LEN);
    let dev = UringDevice::open(&p, &UringOptions { arena_bytes: 1 << 20, ..Default::default() }).unwrap();
    conformance(&dev);
    // Rings are per thread: a second thread gets its own and sees the same bytes.
    let dev = std::sync::Arc::new(dev);
    let d2 = dev.clone();
    std::thread::spawn(move || {
        let (b, r) = d2.read(8192, d2.alloc(4096));
        r.unwrap();
        assert_eq!(&b[..], &pattern(4096, 1)[..]);
    })
    .join()
    .unwrap();
}

#[test]
fn uring_short_read_is_an_error() {
    // A file whose size is not what the device claims: reading past its real end is
    // short, and the engine must say so rather than succeed.
    let (_d, p) = image_file(LEN);
    let f = std::fs::OpenOptions::new().read(true).write(true).open(&p).unwrap();
    let dev = UringDevice::from_file(f, 2 * LEN, &UringOptions::default()).unwrap();
    let (_, r) = dev.read(LEN - 4096, AlignedBuf::new(8192));
    assert_eq!(r, Err(DevError::Short { expected: 8192, got: 4096 }));
    let f = std::fs::OpenOptions::new().read(true).write(true).open(&p).unwrap();
    let dev = PsyncDevice::new(f, 2 * LEN);
    let (_, r) = dev.read(LEN - 4096, AlignedBuf::new(8192));
    assert_eq!(r, Err(DevError::Short { expected: 8192, got: 4096 }));
}

#[test]
fn sim_faults_are_seeded_and_reported() {
    let cfg = SimConfig { seed: 7, write_fail: 0.5, ..Default::default() };
    let run = || {
        let dev = SimDevice::new(vec![0; LEN as usize], cfg.clone());
        (0..64).map(|i| dev.write(i * 4096, AlignedBuf::new(4096)).1.is_ok()).collect::<Vec<_>>()
    };
    let a = run();
    assert_eq!(a, run(), "same seed, same faults");
    assert!(a.iter().any(|ok| *ok) && a.iter().any(|ok| !*ok));
    let dev = SimDevice::new(vec![0; LEN as usize], SimConfig { fail_writes_after: Some(2), ..Default::default() });
    assert!(dev.write(0, AlignedBuf::new(512)).1.is_ok());
    assert!(dev.write(0, AlignedBuf::new(512)).1.is_ok());
    assert_eq!(dev.write(0, AlignedBuf::new(512)).1, Err(DevError::Io(libc::EIO)));
}

#[test]
fn flush_orders_writes_in_crash_images() {
    let dev = SimDevice::new(vec![0; LEN as usize], SimConfig::default());
    let base = dev.start_recording();
    dev.write(0, pattern(4096, 9)).1.unwrap();
    dev.flush().unwrap();
    dev.write(4096, pattern(4096, 10)).1.unwrap();
    let log = dev.log();
    assert!(matches!(log[1], LogEntry::Flush));
    let mut saw_lost = false;
    let mut saw_torn = false;
    for seed in 0..64 {
        let img = crash_image(&base, &log, log.len(), seed);
        // What was flushed always survives.
        assert_eq!(&img[..4096], &pattern(4096, 9)[..], "seed {seed}");
        let after = &img[4096..8192];
        let kept = after.chunks(512).zip(pattern(4096, 10).chunks(512)).filter(|(a, b)| a == b).count();
        saw_lost |= kept == 0;
        saw_torn |= kept > 0 && kept < 8;
    }
    assert!(saw_lost && saw_torn, "unflushed writes can be lost or torn");
    // A crash before the flush may lose the first write too.
    assert!((0..64).any(|s| crash_image(&base, &log, 1, s)[..4096] != pattern(4096, 9)[..]));
}
