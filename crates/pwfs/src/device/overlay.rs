//! overlay: a device whose reads of some blocks return contents held in memory — what
//! a read-only mount uses for the blocks its journal would replay, since it writes
//! nothing home: file data carried by the journal (hitchhiking) included, so that a
//! read-only mount after a crash reads what the fsyncs made durable.

use super::{Device, Done, Op, OpKind, Pending};
use crate::format::BLOCK;
use std::collections::BTreeMap;
use std::sync::Arc;

pub struct Overlay {
    inner: Arc<dyn Device>,
    /// Block number → its 4 KiB contents.
    blocks: BTreeMap<u64, Vec<u8>>,
}

impl Overlay {
    pub fn new(inner: Arc<dyn Device>, blocks: BTreeMap<u64, Vec<u8>>) -> Overlay {
        Overlay { inner, blocks }
    }

    fn touches(&self, op: &Op) -> bool {
        op.kind == OpKind::Read && {
            let first = op.offset / BLOCK;
            let last = (op.offset + op.len()).div_ceil(BLOCK);
            self.blocks.range(first..last).next().is_some()
        }
    }

    /// Copy the overlaid blocks' bytes into a completed read at `offset`.
    fn patch(&self, offset: u64, done: &mut Done) {
        let mut pos = offset;
        for buf in &mut done.bufs {
            let end = pos + buf.len() as u64;
            for (b, data) in self.blocks.range(pos / BLOCK..end.div_ceil(BLOCK)) {
                let (from, to) = ((b * BLOCK).max(pos), ((b + 1) * BLOCK).min(end));
                buf[(from - pos) as usize..(to - pos) as usize]
                    .copy_from_slice(&data[(from - b * BLOCK) as usize..(to - b * BLOCK) as usize]);
            }
            pos = end;
        }
    }
}

impl Device for Overlay {
    fn len(&self) -> u64 {
        self.inner.len()
    }

    /// Batches that read no overlaid block pass through; the others are carried out
    /// at once and patched (a read-only mount's cost, only for those blocks).
    fn start(&self, ops: Vec<Op>) -> Pending {
        if !ops.iter().any(|op| self.touches(op)) {
            return self.inner.start(ops);
        }
        let offsets: Vec<(u64, bool)> = ops.iter().map(|op| (op.offset, self.touches(op))).collect();
        let mut done = self.inner.submit(ops);
        for (d, (offset, touched)) in done.iter_mut().zip(offsets) {
            if touched && d.result.is_ok() {
                self.patch(offset, d);
            }
        }
        Pending::ready(done)
    }

    fn alloc(&self, len: usize) -> super::AlignedBuf {
        self.inner.alloc(len)
    }

    fn alloc_zeroed(&self, len: usize) -> super::AlignedBuf {
        self.inner.alloc_zeroed(len)
    }

    fn name(&self) -> &'static str {
        self.inner.name()
    }
}
