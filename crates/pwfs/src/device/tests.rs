//! One conformance suite, run against every engine.

use super::mem::MemDevice;
use super::psync::PsyncDevice;
use super::sim::{crash_image, LogEntry, SimConfig, SimDevice};
use super::uring::{UringDevice, UringOptions};
use super::*;
use std::time::Duration;

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

/// Read `n` 4 KiB blocks from `at` and check them against `pattern(4096, seed + i)`.
fn check_blocks(dev: &dyn Device, at: u64, n: u64, seed: u8) {
    let done = dev.submit((0..n).map(|i| Op::read(at + i * 4096, dev.alloc(4096))).collect());
    for (i, d) in done.into_iter().enumerate() {
        d.result.unwrap();
        expect_pattern(&d.bufs[0], seed.wrapping_add(i as u8), &format!("block {i} at {at}"));
    }
}

fn writes(at: u64, n: u64, seed: u8) -> Vec<Op> {
    (0..n).map(|i| Op::write(at + i * 4096, pattern(4096, seed.wrapping_add(i as u8)))).collect()
}

fn reads(dev: &dyn Device, at: u64, n: u64) -> Vec<Op> {
    (0..n)
        .map(|i| match i % 3 {
            // Registered, heap and vectored buffers alike.
            0 => Op::read(at + i * 4096, dev.alloc(4096)),
            1 => Op::read(at + i * 4096, AlignedBuf::new(4096)),
            _ => Op { kind: OpKind::Read, offset: at + i * 4096, bufs: vec![dev.alloc(2048), AlignedBuf::new(2048)] },
        })
        .collect()
}

fn joined(d: &Done) -> Vec<u8> {
    d.bufs.iter().flat_map(|b| b.iter().copied()).collect()
}

/// Check a 4 KiB result against `pattern(4096, seed)`, naming the pattern found instead.
fn expect_pattern(got: &[u8], seed: u8, what: &str) {
    if got != &pattern(4096, seed)[..] {
        let found = (0..=255u8).find(|s| got == &pattern(4096, *s)[..]);
        panic!("{what}: want pattern {seed}, found {found:?} (first bytes {:?})", &got[..8.min(got.len())]);
    }
}

/// The asynchronous interface (start, poll, wait, drop), the same on every engine.
fn conformance_async(dev: &dyn Device) {
    // Many ops in one batch, more than any queue depth, results in op order.
    let done = dev.start(writes(0, 150, 10)).wait();
    assert_eq!(done.len(), 150);
    for d in &done {
        d.result.clone().unwrap();
        assert_eq!(d.bufs.len(), 1, "every buffer comes back");
    }
    let done = dev.start(reads(dev, 0, 150)).wait();
    for (i, d) in done.iter().enumerate() {
        d.result.clone().unwrap();
        expect_pattern(&joined(d), 10u8.wrapping_add(i as u8), &format!("read {i}"));
    }
    assert!(dev.start(Vec::new()).wait().is_empty(), "an empty batch");

    // Interleaved handles: several batches in flight together, waited in another order.
    let a = dev.start(reads(dev, 0, 40));
    let b = dev.start(writes(160 * 4096, 40, 50));
    let c = dev.start(reads(dev, 40 * 4096, 40));
    for (i, d) in c.wait().iter().enumerate() {
        d.result.clone().unwrap();
        expect_pattern(&joined(d), 10u8.wrapping_add(40 + i as u8), &format!("read {i}"));
    }
    b.wait().iter().for_each(|d| d.result.clone().unwrap());
    for (i, d) in a.wait().iter().enumerate() {
        d.result.clone().unwrap();
        expect_pattern(&joined(d), 10u8.wrapping_add(i as u8), &format!("read {i}"));
    }
    check_blocks(dev, 160 * 4096, 40, 50);

    // Polling until done, with is_done and with try_done, never blocks the caller.
    let mut p = dev.start(reads(dev, 0, 30));
    while !p.is_done() {
        std::thread::yield_now();
    }
    let done = p.try_done().expect("done once is_done says so");
    assert_eq!(done.len(), 30);
    done.iter().for_each(|d| d.result.clone().unwrap());
    let mut p = dev.start(writes(200 * 4096, 30, 90));
    let done = loop {
        match p.try_done() {
            Ok(done) => break done,
            Err(back) => {
                p = back;
                std::thread::yield_now();
            }
        }
    };
    done.iter().for_each(|d| d.result.clone().unwrap());
    check_blocks(dev, 200 * 4096, 30, 90);

    // A flush in a batch waits for the writes before it; FUA writes, single and vectored.
    let mut ops = writes(0, 8, 20);
    ops.push(Op::flush());
    ops.push(Op::write_fua(8 * 4096, pattern(4096, 28)));
    ops.push(Op { kind: OpKind::WriteFua, offset: 9 * 4096, bufs: vec![pattern(4096, 29), pattern(4096, 30)] });
    ops.push(Op::flush());
    let done = dev.start(ops).wait();
    assert_eq!(done.len(), 12);
    done.iter().for_each(|d| d.result.clone().unwrap());
    assert!(done[8].bufs.is_empty() && done[10].bufs.len() == 2);
    check_blocks(dev, 0, 11, 20);
    dev.flush().unwrap();

    // Errors stay with their op, in a started batch as in a blocking one.
    let done = dev
        .start(vec![
            Op::read(0, AlignedBuf::new(4096)),
            Op::read(100, AlignedBuf::new(512)),
            Op::write(LEN, AlignedBuf::new(512)),
            Op { kind: OpKind::Flush, offset: 0, bufs: vec![AlignedBuf::new(512)] },
            Op::write(4096, AlignedBuf::new(100)),
            Op::read(LEN - 512, AlignedBuf::new(4096)),
            Op::write_fua(LEN - 512, AlignedBuf::new(4096)),
            Op::flush(),
            Op::write(12 * 4096, pattern(4096, 32)),
        ])
        .wait();
    let results: Vec<_> = done.iter().map(|d| d.result.clone()).collect();
    use DevError::{Misaligned, OutOfRange};
    let want = [Ok(()), Err(Misaligned), Err(OutOfRange), Err(Misaligned), Err(Misaligned)];
    assert_eq!(&results[..5], &want);
    assert_eq!(&results[5..], &[Err(OutOfRange), Err(OutOfRange), Ok(()), Ok(())]);
    assert_eq!(done[3].bufs.len(), 1, "a refused flush hands its buffer back");
    assert_eq!(&done[0].bufs[0][..], &pattern(4096, 20)[..]);
    check_blocks(dev, 12 * 4096, 1, 32);
    let done = dev.start(vec![Op::read(7, AlignedBuf::new(512)), Op::read(LEN, AlignedBuf::new(512))]).wait();
    assert_eq!(done[0].result, Err(Misaligned), "a batch of bad ops only");
    assert_eq!(done[1].result, Err(OutOfRange));

    // A dropped handle waits for its ops: its writes are on the device when drop returns.
    drop(dev.start(writes(64 * 4096, 40, 70)));
    check_blocks(dev, 64 * 4096, 40, 70);
    drop(dev.start(reads(dev, 0, 100)));
    // Heap memory the dropped reads used is reused at once; nothing writes into it later.
    let fresh: Vec<AlignedBuf> = (0..100).map(|i| pattern(4096, 200u8.wrapping_add(i as u8))).collect();
    // A panic while I/O is in flight drops the handle during unwinding.
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _p = dev.start(reads(dev, 0, 100));
        let _q = dev.start(writes(120 * 4096, 20, 140));
        panic!("a panic with I/O in flight (expected by the test)");
    }));
    assert!(r.is_err());
    check_blocks(dev, 120 * 4096, 20, 140);
    // A leaked handle leaks its buffers rather than free them under the device.
    std::mem::forget(dev.start(reads(dev, 0, 10)));
    std::thread::sleep(std::time::Duration::from_millis(20));
    for (i, b) in fresh.iter().enumerate() {
        assert_eq!(&b[..], &pattern(4096, 200u8.wrapping_add(i as u8))[..], "reused memory {i} untouched");
    }
    // The device still works after all that.
    dev.write(0, pattern(4096, 3)).1.unwrap();
    check_blocks(dev, 0, 1, 3);

    // A handle may be waited for on another thread, while this one goes on with I/O.
    let p = dev.start(reads(dev, 64 * 4096, 40));
    let q = dev.start(writes(120 * 4096, 20, 160));
    std::thread::scope(|s| {
        let t = s.spawn(move || p.wait());
        let u = s.spawn(move || {
            let mut q = q;
            while !q.is_done() {
                std::thread::yield_now();
            }
            q.wait()
        });
        check_blocks(dev, 0, 1, 3);
        for (i, d) in t.join().unwrap().iter().enumerate() {
            d.result.clone().unwrap();
            expect_pattern(&joined(d), 70u8.wrapping_add(i as u8), &format!("read {i}"));
        }
        u.join().unwrap().iter().for_each(|d| d.result.clone().unwrap());
    });
    check_blocks(dev, 120 * 4096, 20, 160);
}

#[test]
fn mem_engine_conforms() {
    let dev = MemDevice::new(LEN);
    conformance(&dev);
    conformance_async(&dev);
}

#[test]
fn sim_engine_conforms() {
    let dev = SimDevice::new(vec![0; LEN as usize], SimConfig::default());
    conformance(&dev);
    conformance_async(&dev);
    // With latency, handles are not done when `start` returns.
    let dev =
        SimDevice::new(vec![0; LEN as usize], SimConfig { latency: Duration::from_micros(300), ..Default::default() });
    conformance_async(&dev);
}

#[test]
fn psync_engine_conforms() {
    let (_d, p) = image_file(LEN);
    let f = std::fs::OpenOptions::new().read(true).write(true).open(&p).unwrap();
    let dev = PsyncDevice::new(f, LEN);
    conformance(&dev);
    conformance_async(&dev);
}

#[test]
fn uring_engine_conforms() {
    let (_d, p) = image_file(LEN);
    let dev = UringDevice::open(&p, &UringOptions { arena_bytes: 1 << 20, ..Default::default() }).unwrap();
    conformance(&dev);
    // Rings are per thread: a second thread gets its own and sees the same bytes.
    std::thread::scope(|s| {
        s.spawn(|| {
            let (b, r) = dev.read(8192, dev.alloc(4096));
            r.unwrap();
            expect_pattern(&b, 1, "read on a second thread");
        });
    });
    conformance_async(&dev);
    assert_eq!(dev.in_flight(), 0);
    // A small queue: batches wait in the backlog and go on as room frees.
    let small = UringDevice::open(&p, &UringOptions { arena_bytes: 1 << 20, queue_depth: 4, ..Default::default() });
    conformance_async(&small.unwrap());
}

#[test]
fn uring_dropped_handles_drain_before_their_buffers_are_freed() {
    let (_d, p) = image_file(LEN);
    let dev =
        UringDevice::open(&p, &UringOptions { arena_bytes: 1 << 20, queue_depth: 8, ..Default::default() }).unwrap();
    let slots = dev.free_slots();
    dev.submit(writes(0, 64, 1)).into_iter().for_each(|d| d.result.unwrap());
    for round in 0..20 {
        // Registered, heap and vectored reads in flight (and in the backlog), dropped.
        let p = dev.start(reads(&dev, 0, 64));
        let q = dev.start(reads(&dev, 0, 64));
        assert!((1..=8).contains(&dev.in_flight()), "reads in flight, the rest in the backlog");
        drop(p);
        drop(q);
        assert_eq!(dev.in_flight(), 0, "round {round}: nothing in flight once the handles are gone");
        assert_eq!(dev.free_slots(), slots, "round {round}: every registered buffer is back");
        // The same while unwinding from a panic.
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _p = dev.start(reads(&dev, 0, 64));
            let _q = dev.start(writes(64 * 4096, 16, round as u8));
            assert!(dev.in_flight() > 0);
            panic!("a panic with I/O in flight (expected by the test)");
        }));
        assert!(r.is_err());
        assert_eq!(dev.in_flight(), 0);
        assert_eq!(dev.free_slots(), slots);
        check_blocks(&dev, 64 * 4096, 16, round as u8);
    }
    check_blocks(&dev, 0, 64, 1);
    // A handle leaked on a thread that then exits: the ring waits for the reads before
    // it frees them (the buffers themselves are leaked with the handle).
    std::thread::scope(|s| {
        s.spawn(|| std::mem::forget(dev.start(reads(&dev, 0, 64))));
    });
    check_blocks(&dev, 0, 64, 1);
}

#[test]
fn uring_batches_are_waited_for_on_any_thread() {
    let (_d, p) = image_file(LEN);
    let dev =
        UringDevice::open(&p, &UringOptions { arena_bytes: 1 << 20, queue_depth: 4, ..Default::default() }).unwrap();
    dev.submit(writes(0, 128, 7)).into_iter().for_each(|d| d.result.unwrap());
    for round in 0..10u64 {
        // One thread starts every batch on its ring (a queue of 4: most ops wait in the
        // backlog); three threads wait for them, and the starter goes on with I/O.
        let (tx, rx) = std::sync::mpsc::channel::<(u64, Pending)>();
        let rx = std::sync::Mutex::new(rx);
        std::thread::scope(|s| {
            let waiters: Vec<_> = (0..3)
                .map(|_| {
                    s.spawn(|| loop {
                        let Ok((first, p)) = rx.lock().unwrap().recv() else { return };
                        for (i, d) in p.wait().iter().enumerate() {
                            d.result.clone().unwrap();
                            expect_pattern(&joined(d), 7u8.wrapping_add((first + i as u64) as u8), "waited elsewhere");
                        }
                    })
                })
                .collect();
            for b in 0..12u64 {
                let first = (b * 10 + round) % 100;
                tx.send((first, dev.start(reads(&dev, first * 4096, 12)))).unwrap();
                if b % 4 == 0 {
                    check_blocks(&dev, first * 4096, 3, 7u8.wrapping_add(first as u8));
                }
            }
            drop(tx);
            waiters.into_iter().for_each(|w| w.join().unwrap());
        });
        assert_eq!(dev.in_flight(), 0);
    }
}

#[test]
fn sim_handles_finish_after_the_latency() {
    let latency = Duration::from_millis(30);
    let dev = SimDevice::new(vec![0; LEN as usize], SimConfig { latency, ..Default::default() });
    let t = std::time::Instant::now();
    let mut p = dev.start(writes(0, 4, 1));
    assert!(t.elapsed() < latency, "start does not wait");
    assert!(!p.is_done());
    let p = p.try_done().expect_err("not done before the latency");
    let done = p.wait();
    assert!(t.elapsed() >= latency);
    done.iter().for_each(|d| d.result.clone().unwrap());
}

#[test]
fn sim_flush_op_is_logged_like_flush_and_held_flushes_do_not_block_start() {
    let dev = SimDevice::new(vec![0; LEN as usize], SimConfig::default());
    let base = dev.start_recording();
    let mut ops = writes(0, 2, 1);
    ops.push(Op::flush());
    ops.push(Op::write(8192, pattern(4096, 3)));
    dev.submit(ops).iter().for_each(|d| d.result.clone().unwrap());
    dev.flush().unwrap();
    let log = dev.log();
    let kinds: Vec<&str> = log
        .iter()
        .map(|e| match e {
            LogEntry::Write { .. } => "w",
            LogEntry::WriteFua { .. } => "fua",
            LogEntry::Flush => "f",
        })
        .collect();
    assert_eq!(kinds, ["w", "w", "f", "w", "f"]);
    assert_eq!(dev.stats().flushes, 2);
    for seed in 0..16 {
        let img = crash_image(&base, &log, 3, seed);
        expect_pattern(&img[..4096], 1, "flushed by the op");
        expect_pattern(&img[4096..8192], 2, "flushed by the op");
    }

    // A held flush: start returns, the handle is not done, the flush counts as held.
    dev.hold_flushes();
    let mut p = dev.start(vec![Op::write(0, pattern(4096, 5)), Op::flush(), Op::write(4096, pattern(4096, 6))]);
    assert_eq!(dev.flushes_held(), 1);
    assert!(!p.is_done());
    assert_eq!(dev.log_len(), 6, "the write before the flush is done, the flush and the rest wait");
    std::thread::scope(|s| {
        let t = s.spawn(move || p.wait());
        std::thread::sleep(Duration::from_millis(20));
        assert!(!t.is_finished(), "a held flush holds its handle");
        dev.release_flushes();
        t.join().unwrap().iter().for_each(|d| d.result.clone().unwrap());
    });
    assert_eq!(dev.flushes_held(), 0);
    assert!(matches!(dev.log()[6..], [LogEntry::Flush, LogEntry::Write { .. }]));

    // A handle dropped while unwinding gives up what the gate holds (as if the process
    // had died there); its earlier ops are done.
    dev.hold_flushes();
    let len = dev.log_len();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _p = dev.start(vec![Op::write(0, pattern(4096, 7)), Op::flush()]);
        panic!("a panic with a flush held (expected by the test)");
    }));
    assert!(r.is_err());
    assert_eq!(dev.flushes_held(), 0);
    assert_eq!(dev.log_len(), len + 1);
    dev.release_flushes();
}

#[test]
fn sim_fua_writes_survive_every_crash() {
    let dev = SimDevice::new(vec![0; LEN as usize], SimConfig::default());
    let base = dev.start_recording();
    let done = dev.submit(vec![
        Op::write(0, pattern(4096, 1)),
        Op::write_fua(4096, pattern(4096, 2)),
        Op { kind: OpKind::WriteFua, offset: 8192, bufs: vec![pattern(4096, 3), pattern(4096, 4)] },
        Op::write(16384, pattern(4096, 5)),
        // An unflushed write over a FUA write may land or not.
        Op::write(4096, pattern(4096, 6)),
    ]);
    done.iter().for_each(|d| d.result.clone().unwrap());
    let log = dev.log();
    assert!(matches!(log[1], LogEntry::WriteFua { offset: 4096, .. }) && log.len() == 5);
    assert_eq!(dev.stats().fua_writes, 2);
    let (mut lost, mut overwritten) = (false, false);
    for seed in 0..64 {
        for upto in 2..=log.len() {
            let img = crash_image(&base, &log, upto, seed);
            if upto < 5 {
                expect_pattern(&img[4096..8192], 2, "a FUA write is durable when it completes");
            } else {
                let b = &img[4096..8192];
                assert!(b
                    .chunks(512)
                    .zip(pattern(4096, 2).chunks(512))
                    .zip(pattern(4096, 6).chunks(512))
                    .all(|((got, fua), later)| got == fua || got == later));
                overwritten |= b == &pattern(4096, 6)[..];
            }
            if upto >= 3 {
                expect_pattern(&img[8192..12288], 3, "vectored FUA write");
                expect_pattern(&img[12288..16384], 4, "vectored FUA write");
            }
            lost |= img[..4096] != pattern(4096, 1)[..];
        }
    }
    assert!(lost && overwritten, "the plain writes around them can be lost or land");
}

#[test]
fn sim_errors_are_delivered_per_op() {
    let cfg = SimConfig { seed: 3, write_fail: 0.5, read_fail: 0.3, ..Default::default() };
    let dev = SimDevice::new(vec![0; LEN as usize], cfg);
    let mut ops = writes(0, 64, 1);
    ops.extend(reads(&dev, 0, 64));
    let done = dev.start(ops).wait();
    assert_eq!(done.len(), 128);
    let failed = |r: &[Done]| r.iter().filter(|d| d.result == Err(DevError::Io(libc::EIO))).count();
    assert!(failed(&done[..64]) > 0 && failed(&done[..64]) < 64, "some writes fail, some do not");
    assert!(failed(&done[64..]) > 0 && failed(&done[64..]) < 64, "some reads fail, some do not");
    assert!(done.iter().all(|d| d.result.is_ok() || d.result == Err(DevError::Io(libc::EIO))));
    assert!(done[64..].iter().all(|d| d.bufs.len() == 1 || d.bufs.len() == 2), "buffers come back on error");
    // A failing flush fails alone.
    dev.set_config(SimConfig { flush_fail: 1.0, ..Default::default() });
    let done = dev.start(vec![Op::write(0, pattern(4096, 9)), Op::flush(), Op::read(0, AlignedBuf::new(4096))]).wait();
    assert!(done[0].result.is_ok() && done[2].result.is_ok());
    assert_eq!(done[1].result, Err(DevError::Io(libc::EIO)));
    expect_pattern(&done[2].bufs[0], 9, "read after a failed flush");
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

#[test]
fn handles_can_move_between_threads() {
    fn send<T: Send + 'static>() {}
    send::<Pending>();
}
