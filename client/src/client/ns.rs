//! [`NsHandle`]: a namespace bound to a client, and the data-path calls
//! engines make on it (lookup, offload, onboard; shared region or passed
//! fds), each under the call's deadline and failing open.

use super::*;

/// A namespace bound to a client: the calls engines make.
#[derive(Debug)]
pub struct NsHandle<'a> {
    pub(crate) client: &'a Client,
    pub(crate) ns: Namespace,
    pub(crate) id: NamespaceId,
}

pub(crate) fn slot_bytes(payload_len: u64) -> u64 {
    HEADER_BYTES as u64 + padded_len(payload_len)
}

/// An shm onboard reply of at least this many payload bytes is landed
/// (copied and verified) by two threads: at 4 MiB the copy and checksum take
/// about a millisecond, well above a scoped thread's start.
const PARALLEL_LAND_BYTES: u64 = 4 << 20;

/// Where an shm onboard leaves each payload.
pub(crate) enum Landing<'a, 'b> {
    /// Copied out of the staging area into the caller's buffers, and
    /// verified there (where the engine reads it).
    Copy(&'a mut [&'b mut [u8]]),
    /// Left in its pool slot and verified in place.
    Pool(&'a Pool),
}

/// One miss per block of a call that failed as a whole.
pub(crate) fn missed(e: &Error, n: usize) -> Vec<Onboarded> {
    let m = Miss::from_error(e);
    vec![Onboarded::Miss(m); n]
}

/// One failed outcome per block of an offload refused as a whole.
fn missed_offloads(e: &Error, n: usize) -> Vec<OffloadOutcome> {
    vec![OffloadOutcome::Failed(Miss::from_error(e)); n]
}

/// The blocks of a chain: block i's parent is block i-1, `first_parent`
/// for the first. The one place a key list becomes parent links, so every
/// offload of a chain records the same parents.
fn chain_blocks<'p>(
    first_parent: Option<BlockKey>,
    keys: &[BlockKey],
    payloads: &[&'p [u8]],
    hints: Hints,
) -> Vec<OffloadBlock<'p>> {
    let mut parent = first_parent;
    let mut blocks = Vec::with_capacity(keys.len());
    for (k, p) in keys.iter().zip(payloads) {
        blocks.push(OffloadBlock {
            key: *k,
            parent,
            payload: p,
            hints,
        });
        parent = Some(*k);
    }
    blocks
}

impl<'a> NsHandle<'a> {
    /// The namespace.
    pub fn namespace(&self) -> &Namespace {
        &self.ns
    }

    /// Its id.
    pub fn id(&self) -> NamespaceId {
        self.id
    }

    /// Keys of every full block of `tokens`.
    pub fn hash_chain(&self, tokens: &[u32]) -> Vec<BlockKey> {
        self.ns.hash_chain(tokens)
    }

    /// Keys of the full blocks of `tokens` following the block `parent`
    /// ([`Namespace::hash_chain_after`]).
    pub fn hash_chain_after(
        &self,
        parent: Option<BlockKey>,
        tokens: &[u32],
    ) -> Result<Vec<BlockKey>> {
        self.ns.hash_chain_after(parent, tokens)
    }

    /// Tells the daemon this namespace is `engine`'s, for its model
    /// ([`Client::describe`] with the namespace's model id).
    pub fn describe(&self, engine: &str) -> Result<ItemStatus> {
        self.client.describe(self.id, engine, &self.ns.model)
    }

    /// Longest cached prefix of `chain`, with the tier of each block.
    pub fn lookup(&self, chain: &[BlockKey]) -> LookupResult {
        self.client.lookup_id(self.id, chain)
    }

    /// Offloads blocks (batched through the shared region). Never fails as a
    /// whole: each block gets its outcome.
    pub fn offload(&self, blocks: &[OffloadBlock<'_>]) -> Vec<OffloadOutcome> {
        self.offload_with(blocks, &[])
    }

    /// Offloads the full blocks of `tokens`, `payloads[i]` being block i's
    /// KV. `first_parent` is the key of the block before `tokens[0]` (the
    /// last key of an earlier call), None for a chain's start: the keys are
    /// the namespace's hash chain continued after it
    /// ([`Namespace::hash_chain_after`]), so a token list offloaded in
    /// parts gets exactly the keys and parents of hashing it whole. In a
    /// dynamo-mode namespace each block's header also carries its Dynamo
    /// routing facts (parent, tokens_hash, token ids), so the daemon can
    /// announce it to a Dynamo router, now, after a restart and from G4.
    /// Returns the keys and the outcomes (one per full block with a
    /// payload); a parent that cannot be a key of the namespace's mode gets
    /// no keys and a refused outcome per payload.
    pub fn offload_tokens(
        &self,
        first_parent: Option<BlockKey>,
        tokens: &[u32],
        payloads: &[&[u8]],
        hints: Hints,
    ) -> (Vec<BlockKey>, Vec<OffloadOutcome>) {
        // Dynamo mode: one pass gives both the keys and the routing facts.
        let refused = |e: &Error| (Vec::new(), missed_offloads(e, payloads.len()));
        let dynamo = match self.ns.hash_mode {
            crate::HashMode::Dynamo => match self.ns.dynamo_blocks_after(first_parent, tokens) {
                Ok(b) => Some(b),
                Err(e) => return refused(&e),
            },
            _ => None,
        };
        let keys: Vec<BlockKey> = match &dynamo {
            Some(blocks) => blocks
                .iter()
                .map(|b| BlockKey::from_u64(b.sequence_hash))
                .collect(),
            None => match self.ns.hash_chain_after(first_parent, tokens) {
                Ok(k) => k,
                Err(e) => return refused(&e),
            },
        };
        let n = keys.len().min(payloads.len());
        let mut metas = Vec::with_capacity(n);
        if let Some(blocks) = &dynamo {
            let bt = self.ns.layout.tokens_per_block as usize;
            let mut parent = first_parent.and_then(|k| k.as_u64());
            for (i, b) in blocks.iter().take(n).enumerate() {
                metas.push(Some(crate::block::DynamoMeta {
                    parent,
                    tokens_hash: b.tokens_hash,
                    token_ids: tokens[i * bt..(i + 1) * bt].to_vec(),
                }));
                parent = Some(b.sequence_hash);
            }
        }
        let blocks = chain_blocks(first_parent, &keys[..n], payloads, hints);
        let out = self.offload_with(&blocks, &metas);
        (keys[..n].to_vec(), out)
    }

    /// [`Self::offload`] with block i's header carrying `dynamo[i]` when
    /// given.
    fn offload_with(
        &self,
        blocks: &[OffloadBlock<'_>],
        dynamo: &[Option<crate::block::DynamoMeta>],
    ) -> Vec<OffloadOutcome> {
        let mut out = Vec::with_capacity(blocks.len());
        let region_len = self.client.cfg.region_bytes.div_ceil(4096) * 4096;
        let mut i = 0;
        while i < blocks.len() {
            // Pack as many blocks as fit in the region.
            let mut end = i;
            let mut used = 0u64;
            while end < blocks.len() && end - i < KEYS_MAX {
                let s = slot_bytes(blocks[end].payload.len() as u64);
                if used + s > region_len {
                    break;
                }
                used += s;
                end += 1;
            }
            if end == i {
                out.push(OffloadOutcome::Failed(Miss::new(
                    MissCause::TooLarge,
                    "block larger than the shared region",
                )));
                i += 1;
                continue;
            }
            let batch = &blocks[i..end];
            let r = self.client.call(
                |region| {
                    let region = region.ok_or_else(|| Error::Protocol {
                        reason: "client has no shared region".into(),
                    })?;
                    let mut items = Vec::with_capacity(batch.len());
                    let mut off = 0u64;
                    let created = now_ms();
                    for (j, b) in batch.iter().enumerate() {
                        let mut h = BlockHeader::for_payload(&self.ns, b.key, b.payload, created);
                        if let Some(Some(m)) = dynamo.get(i + j) {
                            h = h.with_dynamo(m.clone());
                        }
                        let mut hb = [0u8; HEADER_BYTES];
                        h.encode_into(&mut hb);
                        region.write(off, &hb);
                        region.write(off + HEADER_BYTES as u64, b.payload);
                        items.push(OffloadItem {
                            shm_offset: off,
                            parent: b.parent,
                            hints: b.hints,
                        });
                        off += slot_bytes(b.payload.len() as u64);
                    }
                    Ok(Request::Offload { ns: self.id, items })
                },
                |_, r, _| match r {
                    Response::Items { status } if status.len() == batch.len() => Ok(status),
                    other => Err(unexpected(other)),
                },
            );
            match r {
                Ok(status) => out.extend(status.into_iter().map(OffloadOutcome::from_status)),
                Err(e) => {
                    let m = Miss::from_error(&e);
                    out.extend(batch.iter().map(|_| OffloadOutcome::Failed(m.clone())));
                }
            }
            i = end;
        }
        out
    }

    /// Offloads a chain: block i's parent is block i-1 (`first_parent` for
    /// the first).
    pub fn offload_chain(
        &self,
        first_parent: Option<BlockKey>,
        keys: &[BlockKey],
        payloads: &[&[u8]],
        hints: Hints,
    ) -> Vec<OffloadOutcome> {
        self.offload(&chain_blocks(first_parent, keys, payloads, hints))
    }

    /// Onboards `keys[i]` into `bufs[i]` (each at least the block's payload
    /// size), verifying every byte (see the module docs). Never fails as a
    /// whole: each key gets its outcome.
    pub fn onboard_into(&self, keys: &[BlockKey], bufs: &mut [&mut [u8]]) -> Vec<Onboarded> {
        let n = keys.len().min(bufs.len());
        let mut out: Vec<Onboarded> = Vec::with_capacity(keys.len());
        let slot = slot_bytes(self.ns.layout.block_bytes());
        let region_len = self.client.cfg.region_bytes.div_ceil(4096) * 4096;
        let direct = self.client.cfg.direct_read;
        let per_batch = if direct {
            FDS_MAX
        } else {
            ((region_len / slot.max(1)) as usize).min(KEYS_MAX)
        };
        if per_batch == 0 {
            for _ in 0..keys.len() {
                out.push(Onboarded::Miss(Miss::new(
                    MissCause::TooLarge,
                    "block larger than the shared region",
                )));
            }
            return out;
        }
        // More blocks than the region holds: two requests in flight, each
        // in half of the region (a block per half at least).
        if !direct && n > per_batch && per_batch >= 2 {
            let mut out =
                self.onboard_shm_pipelined(&keys[..n], &mut bufs[..n], slot, per_batch / 2);
            for _ in n..keys.len() {
                out.push(Onboarded::Miss(Miss::new(
                    MissCause::TooLarge,
                    "no buffer given for this key",
                )));
            }
            return out;
        }
        let mut i = 0;
        while i < n {
            let end = (i + per_batch).min(n);
            let res = if direct {
                let mut res = self.onboard_direct(&keys[i..end], &mut bufs[i..end]);
                self.retry_in_region(&keys[i..end], &mut bufs[i..end], &mut res, slot, region_len);
                res
            } else {
                self.onboard_shm(&keys[i..end], &mut bufs[i..end], slot)
            };
            out.extend(res);
            i = end;
        }
        for _ in n..keys.len() {
            out.push(Onboarded::Miss(Miss::new(
                MissCause::TooLarge,
                "no buffer given for this key",
            )));
        }
        out
    }

    /// Validates a header the daemon produced against the request and reply.
    pub(crate) fn check_header(
        &self,
        hb: &[u8],
        key: &BlockKey,
        it: &proto::OnboardResult,
        cap: usize,
    ) -> std::result::Result<BlockHeader, Miss> {
        let h =
            BlockHeader::decode(hb).map_err(|e| Miss::new(MissCause::Corrupt, e.to_string()))?;
        if h.key != *key
            || h.namespace_digest != self.ns.digest()
            || h.payload_len != it.payload_len
            || h.payload_sum != it.payload_sum
        {
            return Err(Miss::new(
                MissCause::Corrupt,
                format!("header for {key} disagrees with the request or reply"),
            ));
        }
        if h.payload_len as usize > cap {
            return Err(Miss::new(
                MissCause::TooLarge,
                format!("block of {} bytes, buffer of {cap}", h.payload_len),
            ));
        }
        Ok(h)
    }

    fn onboard_shm(&self, keys: &[BlockKey], bufs: &mut [&mut [u8]], slot: u64) -> Vec<Onboarded> {
        let offsets: Vec<u64> = (0..keys.len() as u64).map(|j| j * slot).collect();
        self.onboard_shm_at(keys, &offsets, slot, Landing::Copy(bufs))
            .unwrap_or_else(|e| missed(&e, keys.len()))
    }

    /// One shm-mode onboard request, for the staging area and the pool
    /// alike: the daemon places `keys[j]` (header page, then payload) in the
    /// region at `offsets[j]`; each hit's header is validated against the
    /// request and the reply, and its payload lands as `landing` says and
    /// is verified (its checksum) where it lands. An error (no region, a failed
    /// call, a reply of the wrong length) is the caller's to turn into
    /// misses.
    ///
    /// The daemon leaves a payload's checksum to this check (it reads G3
    /// blocks straight into the region, checking only their headers), so
    /// a block that the daemon served and that fails here is reported
    /// (`OP_REPORT_CORRUPT`: the daemon re-verifies its copy, quarantines
    /// it and repairs it from G4 or a peer) and, where the daemon repaired
    /// it or found its own copy good, onboarded once more in the same call.
    pub(crate) fn onboard_shm_at(
        &self,
        keys: &[BlockKey],
        offsets: &[u64],
        slot: u64,
        mut landing: Landing<'_, '_>,
    ) -> Result<Vec<Onboarded>> {
        let all: Vec<usize> = (0..keys.len()).collect();
        let (mut out, failed) = self.onboard_shm_once(keys, offsets, &all, slot, &mut landing)?;
        if failed.is_empty() {
            return Ok(out);
        }
        let bad: Vec<BlockKey> = failed.iter().map(|&j| keys[j]).collect();
        let Ok(status) = self.client.report_corrupt(self.id, &bad) else {
            return Ok(out);
        };
        let again: Vec<usize> = failed
            .iter()
            .zip(&status)
            .filter(|(_, st)| matches!(st, ItemStatus::Repaired | ItemStatus::Ok))
            .map(|(&j, _)| j)
            .collect();
        if again.is_empty() {
            return Ok(out);
        }
        let ks: Vec<BlockKey> = again.iter().map(|&j| keys[j]).collect();
        let os: Vec<u64> = again.iter().map(|&j| offsets[j]).collect();
        if let Ok((got, _)) = self.onboard_shm_once(&ks, &os, &again, slot, &mut landing) {
            for (&j, o) in again.iter().zip(got) {
                out[j] = o;
            }
        }
        Ok(out)
    }

    /// One shm onboard request: `keys[i]` lands as item `dest[i]` of
    /// `landing`. The outcomes, and the items (of `landing`) that the
    /// daemon served and this client's check refused.
    fn onboard_shm_once(
        &self,
        keys: &[BlockKey],
        offsets: &[u64],
        dest: &[usize],
        slot: u64,
        landing: &mut Landing<'_, '_>,
    ) -> Result<(Vec<Onboarded>, Vec<usize>)> {
        let pool = match &*landing {
            Landing::Pool(p) => Some(*p),
            Landing::Copy(_) => None,
        };
        self.client.call(
            |region| self.shm_request(region, pool, keys, offsets, slot),
            |region, r, _| self.shm_reply(region, r, keys, offsets, dest, landing),
        )
    }

    /// The onboard request that places `keys[j]` at `offsets[j]` of the
    /// region (the pool's, when `pool` is given).
    fn shm_request(
        &self,
        region: Option<&Region>,
        pool: Option<&Pool>,
        keys: &[BlockKey],
        offsets: &[u64],
        slot: u64,
    ) -> Result<Request> {
        let region = region.ok_or_else(|| Error::Protocol {
            reason: "client has no shared region".into(),
        })?;
        if let Some(p) = pool {
            p.check_region(region)?;
        }
        // The daemon writes these ranges: their pages must be this
        // process's (charged to its memory cgroup, see shm.rs); it
        // refuses ranges with holes. A no-op once populated.
        for &o in offsets {
            region.populate(o, slot as usize);
        }
        let items = keys
            .iter()
            .zip(offsets)
            .map(|(k, &o)| OnboardItem {
                key: *k,
                shm_offset: o,
                shm_len: slot,
            })
            .collect();
        Ok(Request::Onboard {
            ns: self.id,
            mode: OnboardMode::Shm,
            lease_ttl_ms: 0,
            items,
        })
    }

    /// An shm onboard reply landed: the outcomes, and the items (of
    /// `landing`) that the daemon served and this client's check refused.
    fn shm_reply(
        &self,
        region: Option<&Region>,
        r: Response,
        keys: &[BlockKey],
        offsets: &[u64],
        dest: &[usize],
        landing: &mut Landing<'_, '_>,
    ) -> Result<(Vec<Onboarded>, Vec<usize>)> {
        let Response::Onboard { items } = r else {
            return Err(unexpected(r));
        };
        if items.len() != keys.len() {
            return Err(Error::Protocol {
                reason: "onboard reply length".into(),
            });
        }
        let region = region.ok_or_else(poisoned)?;
        let got = self.land_all(region, keys, &items, offsets, dest, landing);
        let mut failed = Vec::new();
        let out = got
            .into_iter()
            .zip(&items)
            .zip(dest)
            .map(|((r, it), &j)| match r {
                Ok(o) => o,
                Err(m) => {
                    if it.status == ItemStatus::Ok && m.cause == MissCause::Corrupt {
                        failed.push(j);
                    }
                    Onboarded::Miss(m)
                }
            })
            .collect();
        Ok((out, failed))
    }

    /// Onboards more blocks than the region holds at once into `bufs`:
    /// requests of `half` blocks each, alternating between the region's
    /// two halves, two in flight on the connection
    /// ([`Client::call_pipelined`]), so the daemon reads one half while
    /// this client copies and checks the other. Blocks this client's check
    /// refused are reported and, where the daemon repaired them or found
    /// its copy good, onboarded once more, as [`Self::onboard_shm_at`].
    fn onboard_shm_pipelined(
        &self,
        keys: &[BlockKey],
        bufs: &mut [&mut [u8]],
        slot: u64,
        half: usize,
    ) -> Vec<Onboarded> {
        let n = keys.len().min(bufs.len());
        let half = half.max(1);
        let count = n.div_ceil(half);
        let range = |b: usize| b * half..((b + 1) * half).min(n);
        let offsets = |b: usize| -> Vec<u64> {
            let base = (b % 2) as u64 * half as u64 * slot;
            range(b)
                .map(|j| base + (j - b * half) as u64 * slot)
                .collect()
        };
        let mut out: Vec<Option<Onboarded>> = vec![None; n];
        let mut failed: Vec<usize> = Vec::new();
        let res = self.client.call_pipelined(
            count,
            |b, region| self.shm_request(region, None, &keys[range(b)], &offsets(b), slot),
            |b, region, r| {
                let rg = range(b);
                let dest: Vec<usize> = (0..rg.len()).collect();
                let mut landing = Landing::Copy(&mut bufs[rg.clone()]);
                let (got, bad) = self.shm_reply(
                    region,
                    r,
                    &keys[rg.clone()],
                    &offsets(b),
                    &dest,
                    &mut landing,
                )?;
                for (j, o) in got.into_iter().enumerate() {
                    out[rg.start + j] = Some(o);
                }
                failed.extend(bad.into_iter().map(|j| rg.start + j));
                Ok(())
            },
        );
        let gone = res.err().map(|e| Miss::from_error(&e));
        let mut out: Vec<Onboarded> = out
            .into_iter()
            .map(|o| {
                o.unwrap_or_else(|| {
                    Onboarded::Miss(gone.clone().unwrap_or_else(|| {
                        Miss::new(MissCause::Unavailable, "onboard request not answered")
                    }))
                })
            })
            .collect();
        if failed.is_empty() {
            return out;
        }
        let bad: Vec<BlockKey> = failed.iter().map(|&j| keys[j]).collect();
        let Ok(status) = self.client.report_corrupt(self.id, &bad) else {
            return out;
        };
        for (&j, st) in failed.iter().zip(&status) {
            if !matches!(st, ItemStatus::Repaired | ItemStatus::Ok) {
                continue;
            }
            let mut one = [&mut *bufs[j]];
            if let Some(o) = self
                .onboard_shm_at(&keys[j..=j], &[0], slot, Landing::Copy(&mut one))
                .ok()
                .and_then(|mut v| v.pop())
            {
                out[j] = o;
            }
        }
        out
    }

    /// Lands every item of an shm onboard reply (`items[i]` for `keys[i]`
    /// at `offsets[i]`, into item `dest[i]` of `landing`). A reply of at
    /// least [`PARALLEL_LAND_BYTES`] is landed by this thread and one
    /// scoped helper, half the items each: the copy and the checksum pass
    /// are the client's whole share of an onboard, and while they run the
    /// connection, and so the daemon's reads for this client, wait.
    fn land_all(
        &self,
        region: &Region,
        keys: &[BlockKey],
        items: &[proto::OnboardResult],
        offsets: &[u64],
        dest: &[usize],
        landing: &mut Landing<'_, '_>,
    ) -> Vec<std::result::Result<Onboarded, Miss>> {
        let copy = matches!(landing, Landing::Copy(_));
        // Each item's destination: its own buffer (copy), or its pool slot.
        let mut dsts: Vec<Option<&mut [u8]>> = match landing {
            Landing::Copy(bufs) => {
                let mut by_dest: Vec<Option<&mut [u8]>> =
                    bufs.iter_mut().map(|b| Some(&mut **b)).collect();
                dest.iter()
                    .map(|&j| by_dest.get_mut(j).and_then(Option::take))
                    .collect()
            }
            Landing::Pool(_) => dest.iter().map(|_| None).collect(),
        };
        let one = |i: usize, dst: Option<&mut [u8]>| {
            self.land(region, &keys[i], &items[i], offsets[i], copy, dst)
        };
        let bytes: u64 = items
            .iter()
            .filter(|it| it.status == ItemStatus::Ok)
            .map(|it| it.payload_len)
            .sum();
        let n = items.len().min(keys.len()).min(offsets.len());
        if bytes < PARALLEL_LAND_BYTES || n < 2 {
            return (0..n).zip(dsts).map(|(i, d)| one(i, d)).collect();
        }
        let half = n / 2;
        let (a, b) = dsts.split_at_mut(half);
        std::thread::scope(|s| {
            let helper = s.spawn(|| {
                (half..n)
                    .zip(b.iter_mut())
                    .map(|(i, d)| one(i, d.take()))
                    .collect::<Vec<_>>()
            });
            let mut out: Vec<_> = (0..half)
                .zip(a.iter_mut())
                .map(|(i, d)| one(i, d.take()))
                .collect();
            match helper.join() {
                Ok(rest) => out.extend(rest),
                Err(_) => out.extend((half..n).map(|_| {
                    Err(Miss::new(
                        MissCause::Corrupt,
                        "verification thread panicked",
                    ))
                })),
            }
            out
        })
    }

    /// One item of an shm onboard reply: its header checked, its payload
    /// landed and verified: copied into `dst` and checked there (`copy`),
    /// or checked in its pool slot in the region.
    fn land(
        &self,
        region: &Region,
        key: &BlockKey,
        it: &proto::OnboardResult,
        at: u64,
        copy: bool,
        dst: Option<&mut [u8]>,
    ) -> std::result::Result<Onboarded, Miss> {
        if it.status != ItemStatus::Ok {
            return Err(Miss::from_status(it.status));
        }
        let mut hb = [0u8; HEADER_BYTES];
        if !region.read(at, &mut hb) {
            return Err(Miss::new(MissCause::Corrupt, "offset"));
        }
        let cap = match (&dst, copy) {
            (Some(d), true) => d.len(),
            (None, true) => 0,
            (_, false) => self.ns.layout.block_bytes() as usize,
        };
        let h = self.check_header(&hb, key, it, cap)?;
        let (at, len) = (at + HEADER_BYTES as u64, h.payload_len as usize);
        let Some(src) = region.slice(at, len) else {
            return Err(Miss::new(MissCause::TooLarge, "region"));
        };
        let verified = match dst {
            Some(d) if copy => h.copy_verified(src, &mut d[..len]),
            _ => h.verify_payload(src),
        };
        verified.map_err(|e| Miss::new(MissCause::Corrupt, e.to_string()))?;
        Ok(Onboarded::Hit {
            tier: it.tier,
            payload_len: h.payload_len,
        })
    }

    /// The blocks an fd onboard missed for a storage failure (the G3 copy
    /// could not be opened or read, or a block fetched from a peer or G4
    /// could not be written to G3 to be passed as a file) are asked for
    /// once more through the shared region, where the daemon serves
    /// another tier's verified copy instead: a failing or full G3 costs
    /// the fd path no hit the region path would give.
    fn retry_in_region(
        &self,
        keys: &[BlockKey],
        bufs: &mut [&mut [u8]],
        res: &mut [Onboarded],
        slot: u64,
        region_len: u64,
    ) {
        let retry: Vec<usize> = res
            .iter()
            .enumerate()
            .filter(|(_, o)| {
                matches!(o, Onboarded::Miss(m) if matches!(m.cause, MissCause::Storage | MissCause::NoSpace))
            })
            .map(|(j, _)| j)
            .collect();
        let per_batch = ((region_len / slot.max(1)) as usize).min(KEYS_MAX);
        if retry.is_empty() || per_batch == 0 {
            return;
        }
        for part in retry.chunks(per_batch) {
            let ks: Vec<BlockKey> = part.iter().map(|&j| keys[j]).collect();
            let mut by_index: Vec<Option<&mut [u8]>> =
                bufs.iter_mut().map(|b| Some(&mut **b)).collect();
            let mut bs: Vec<&mut [u8]> = part
                .iter()
                .filter_map(|&j| by_index.get_mut(j).and_then(Option::take))
                .collect();
            if bs.len() != ks.len() {
                return;
            }
            for (&j, o) in part.iter().zip(self.onboard_shm(&ks, &mut bs, slot)) {
                // A second miss keeps the first one's cause (what failed).
                if o.is_hit() {
                    res[j] = o;
                }
            }
        }
    }

    fn onboard_direct(&self, keys: &[BlockKey], bufs: &mut [&mut [u8]]) -> Vec<Onboarded> {
        let caps: Vec<usize> = bufs.iter().map(|b| b.len()).collect();
        let d = self.open_direct(keys, &caps);
        // Each item read from its file into its buffer and verified there;
        // Err(true) marks a corrupt copy, to be reported.
        let one = |j: usize, buf: &mut [u8]| -> std::result::Result<Onboarded, (Miss, bool)> {
            let b = d.items[j].as_ref().map_err(|m| (m.clone(), false))?;
            let dst = &mut buf[..b.header.payload_len as usize];
            d.file(b)
                .read_exact_at(dst, b.payload_offset)
                .map_err(|e| (Miss::new(MissCause::Storage, e.to_string()), false))?;
            b.header
                .verify_payload(dst)
                .map(|()| b.hit())
                .map_err(|e| (Miss::new(MissCause::Corrupt, e.to_string()), true))
        };
        let n = d.items.len().min(bufs.len());
        let bytes: u64 = d
            .items
            .iter()
            .filter_map(|it| it.as_ref().ok())
            .map(|b| b.header.payload_len)
            .sum();
        let results: Vec<_> = if bytes < PARALLEL_LAND_BYTES || n < 2 {
            bufs.iter_mut()
                .take(n)
                .enumerate()
                .map(|(j, b)| one(j, b))
                .collect()
        } else {
            // Two readers, half the blocks each: one thread's checksum pass
            // runs while the other's read waits on the disk, and the disk
            // sees two reads at once (as the shm path lands with two).
            let half = n / 2;
            let (a, b) = bufs[..n].split_at_mut(half);
            std::thread::scope(|s| {
                let helper = s.spawn(|| {
                    b.iter_mut()
                        .enumerate()
                        .map(|(j, buf)| one(half + j, buf))
                        .collect::<Vec<_>>()
                });
                let mut out: Vec<_> = a
                    .iter_mut()
                    .enumerate()
                    .map(|(j, buf)| one(j, buf))
                    .collect();
                match helper.join() {
                    Ok(rest) => out.extend(rest),
                    Err(_) => out.extend((half..n).map(|_| {
                        Err((
                            Miss::new(MissCause::Storage, "reader thread panicked"),
                            false,
                        ))
                    })),
                }
                out
            })
        };
        let mut corrupt = Vec::new();
        let mut out = Vec::with_capacity(keys.len());
        for (j, r) in results.into_iter().enumerate() {
            out.push(match r {
                Ok(hit) => hit,
                Err((m, bad)) => {
                    if bad {
                        corrupt.push(keys[j]);
                    }
                    Onboarded::Miss(m)
                }
            });
        }
        // Items past the buffers given (none when called by onboard_into).
        for it in d.items.iter().skip(n) {
            out.push(Onboarded::Miss(match it {
                Err(m) => m.clone(),
                Ok(_) => Miss::new(MissCause::TooLarge, "no buffer given for this key"),
            }));
        }
        self.finish_direct(d, &corrupt);
        out
    }

    /// Asks the daemon for the block files of `keys` (at most
    /// [`FDS_MAX`]; more are misses), each leased until
    /// [`Self::finish_direct`] or the call's deadline, and checks each
    /// header against the request and the reply, and its payload against
    /// `caps[i]` (the bytes the caller can take for key i). The payload is
    /// neither read nor verified: the caller reads
    /// `header.payload_len` bytes at `payload_offset` of [`DirectBlocks::file`]
    /// (the GPU crate with its own pipeline, say) and must compare their
    /// checksum with `header.payload_sum` before using them (the daemon
    /// hands fds out unverified). A failed call is a miss for every key.
    pub fn open_direct(&self, keys: &[BlockKey], caps: &[usize]) -> DirectBlocks {
        let n = keys.len().min(FDS_MAX).min(caps.len());
        let mut d = DirectBlocks {
            files: Vec::new(),
            items: Vec::with_capacity(keys.len()),
            leases: Vec::new(),
            corrupt: Vec::new(),
        };
        let r = if n == 0 {
            Ok((Vec::new(), Vec::new()))
        } else {
            self.client.call(
                |_| {
                    let items = keys[..n]
                        .iter()
                        .map(|k| OnboardItem {
                            key: *k,
                            shm_offset: 0,
                            shm_len: 0,
                        })
                        .collect();
                    Ok(Request::Onboard {
                        ns: self.id,
                        mode: OnboardMode::DirectFd,
                        lease_ttl_ms: self.client.cfg.timeout_ms.min(u32::MAX as u64) as u32,
                        items,
                    })
                },
                |_, r, fds| match r {
                    Response::Onboard { items } if items.len() == n => Ok((items, fds)),
                    other => Err(unexpected(other)),
                },
            )
        };
        let items = match r {
            Ok((items, fds)) => {
                d.files = fds.into_iter().map(std::fs::File::from).collect();
                items
            }
            Err(e) => {
                d.items = missed(&e, keys.len())
                    .into_iter()
                    .map(|o| match o {
                        Onboarded::Miss(m) => Err(m),
                        Onboarded::Hit { .. } => Err(Miss::new(MissCause::Refused, "no reply")),
                    })
                    .collect();
                return d;
            }
        };
        for (j, it) in items.iter().enumerate() {
            if it.lease_id != 0 {
                d.leases.push(it.lease_id);
            }
            let got = self.open_one(&d.files, &keys[j], it, caps[j]);
            if let Err(m) = &got {
                if m.cause == MissCause::Corrupt && it.status == ItemStatus::Ok {
                    d.corrupt.push(keys[j]);
                }
            }
            d.items.push(got);
        }
        for _ in n..keys.len() {
            d.items.push(Err(Miss::new(
                MissCause::TooLarge,
                "more keys than one direct read takes, or no buffer for this key",
            )));
        }
        d
    }

    /// One item of a direct-read reply: its fd and its header, checked.
    fn open_one(
        &self,
        files: &[std::fs::File],
        key: &BlockKey,
        it: &proto::OnboardResult,
        cap: usize,
    ) -> std::result::Result<DirectBlock, Miss> {
        if it.status != ItemStatus::Ok {
            return Err(Miss::from_status(it.status));
        }
        let file = it.fd_index as usize;
        let Some(f) = files.get(file) else {
            return Err(Miss::new(MissCause::Refused, "missing fd"));
        };
        let mut hb = vec![0u8; HEADER_BYTES];
        f.read_exact_at(&mut hb, it.file_offset)
            .map_err(|e| Miss::new(MissCause::Storage, e.to_string()))?;
        let header = self.check_header(&hb, key, it, cap)?;
        Ok(DirectBlock {
            file,
            payload_offset: it.file_offset + HEADER_BYTES as u64,
            header,
            tier: it.tier,
        })
    }

    /// Ends a direct read: gives the leases back, and reports to the daemon
    /// the blocks whose header (found by [`Self::open_direct`]) or payload
    /// (`corrupt`: found by the caller's verification) failed, so that it
    /// re-verifies, quarantines and repairs them. Best effort: leases time
    /// out anyway, and the misses stand whatever the answer.
    pub fn finish_direct(&self, d: DirectBlocks, corrupt: &[BlockKey]) {
        let _ = self.client.release(&d.leases);
        let mut all = d.corrupt;
        all.extend_from_slice(corrupt);
        if !all.is_empty() {
            self.report_corrupt(&all);
        }
    }

    /// Tells the daemon that blocks read over a passed fd failed this
    /// client's verification: the daemon re-verifies its copy and, on a
    /// real mismatch, quarantines and repairs it, so the corrupt copy is
    /// not served again (the daemon hands fds out unverified). Best
    /// effort: the miss stands whatever the answer (a later onboard reads
    /// the repaired copy).
    fn report_corrupt(&self, keys: &[BlockKey]) {
        let _ = self.client.report_corrupt(self.id, keys);
    }

    fn keys_op(
        &self,
        keys: &[BlockKey],
        mk: impl Fn(Vec<BlockKey>) -> Request,
    ) -> Result<Vec<ItemStatus>> {
        let mut out = Vec::with_capacity(keys.len());
        for part in keys.chunks(KEYS_MAX) {
            out.extend(self.client.call(
                |_| Ok(mk(part.to_vec())),
                |_, r, _| match r {
                    Response::Items { status } if status.len() == part.len() => Ok(status),
                    other => Err(unexpected(other)),
                },
            )?);
        }
        Ok(out)
    }

    /// Pins keys for `ttl_ms` (the daemon caps it): they are not evicted.
    pub fn pin(&self, keys: &[BlockKey], ttl_ms: u32) -> Result<Vec<ItemStatus>> {
        self.keys_op(keys, |keys| Request::Pin {
            ns: self.id,
            ttl_ms,
            keys,
        })
    }

    /// "This chain will be needed within `deadline_ms`": the daemon fetches
    /// the blocks that are not local (from peers or G4) into G3 in the
    /// background, so the request that follows finds them local. Returns at
    /// once; per key `Ok` (queued), `AlreadyPresent` (local), `LimitReached`
    /// (no room in the daemon's queue or this uid's share; also every key
    /// past the first `KEYS_MAX`, which one prefetch does not carry) or
    /// `Absent` (the daemon has no remote tier). A later prefetch with the
    /// same non-zero `stream` (a request or session id of the caller's
    /// choosing) drops the queued keys it no longer names; 0 never does.
    pub fn prefetch(
        &self,
        keys: &[BlockKey],
        deadline_ms: u32,
        stream: u64,
    ) -> Result<Vec<ItemStatus>> {
        // One frame: split in two, the second part would supersede the first.
        let (sent, rest) = keys.split_at(keys.len().min(KEYS_MAX));
        let mut out = self.keys_op(sent, |keys| Request::Prefetch {
            ns: self.id,
            deadline_ms,
            stream,
            keys,
        })?;
        out.extend(std::iter::repeat_n(ItemStatus::LimitReached, rest.len()));
        Ok(out)
    }

    /// Removes pins.
    pub fn unpin(&self, keys: &[BlockKey]) -> Result<Vec<ItemStatus>> {
        self.keys_op(keys, |keys| Request::Unpin { ns: self.id, keys })
    }

    /// Evicts keys from the node's disk (leased or pinned keys are
    /// refused); G4 keeps its copies. See [`Self::evict_from`].
    pub fn evict(&self, keys: &[BlockKey]) -> Result<Vec<ItemStatus>> {
        self.evict_from(keys, crate::proto::EvictTier::G3)
    }

    /// Evicts keys from `tier` ([`Client::evict_ids`]).
    pub fn evict_from(
        &self,
        keys: &[BlockKey],
        tier: crate::proto::EvictTier,
    ) -> Result<Vec<ItemStatus>> {
        self.client.evict_ids(self.id, keys, tier)
    }

    /// Metadata of keys.
    pub fn stat(&self, keys: &[BlockKey]) -> Result<Vec<Option<BlockStat>>> {
        self.client.stat_ids(self.id, keys)
    }
}

/// The async API (feature `async`): the blocking client driven from
/// tokio's blocking pool, so an async engine never blocks its reactor.
#[cfg(feature = "async")]
pub mod nonblocking {
    use super::*;
    use std::sync::Arc;

    /// An async handle over a shared [`Client`].
    #[derive(Debug, Clone)]
    pub struct AsyncClient {
        inner: Arc<Client>,
    }

    impl AsyncClient {
        /// Wraps a client.
        pub fn new(client: Client) -> Self {
            AsyncClient {
                inner: Arc::new(client),
            }
        }

        /// See [`NsHandle::lookup`].
        pub async fn lookup(&self, ns: Namespace, chain: Vec<BlockKey>) -> LookupResult {
            let c = self.inner.clone();
            let r = tokio::task::spawn_blocking(move || c.namespace(&ns).lookup(&chain)).await;
            r.unwrap_or_else(|_| LookupResult {
                tiers: Vec::new(),
                miss: Some(Miss::new(MissCause::Unavailable, "task failed")),
            })
        }

        /// See [`NsHandle::offload`]; blocks are (key, parent, payload).
        pub async fn offload(
            &self,
            ns: Namespace,
            blocks: Vec<(BlockKey, Option<BlockKey>, Vec<u8>)>,
            hints: Hints,
        ) -> Vec<OffloadOutcome> {
            let c = self.inner.clone();
            let n = blocks.len();
            let r = tokio::task::spawn_blocking(move || {
                let bs: Vec<OffloadBlock<'_>> = blocks
                    .iter()
                    .map(|(k, p, b)| OffloadBlock {
                        key: *k,
                        parent: *p,
                        payload: b,
                        hints,
                    })
                    .collect();
                c.namespace(&ns).offload(&bs)
            })
            .await;
            r.unwrap_or_else(|_| {
                vec![OffloadOutcome::Failed(Miss::new(MissCause::Unavailable, "task failed")); n]
            })
        }

        /// See [`NsHandle::onboard_into`]; returns a fresh buffer per key.
        pub async fn onboard(
            &self,
            ns: Namespace,
            keys: Vec<BlockKey>,
        ) -> Vec<(Onboarded, Vec<u8>)> {
            let c = self.inner.clone();
            let n = keys.len();
            let r = tokio::task::spawn_blocking(move || {
                let len = ns.layout.block_bytes() as usize;
                let mut bufs: Vec<Vec<u8>> = keys.iter().map(|_| vec![0u8; len]).collect();
                let mut refs: Vec<&mut [u8]> = bufs.iter_mut().map(|b| &mut b[..]).collect();
                let res = c.namespace(&ns).onboard_into(&keys, &mut refs);
                res.into_iter().zip(bufs).collect::<Vec<_>>()
            })
            .await;
            r.unwrap_or_else(|_| {
                (0..n)
                    .map(|_| {
                        (
                            Onboarded::Miss(Miss::new(MissCause::Unavailable, "task failed")),
                            Vec::new(),
                        )
                    })
                    .collect()
            })
        }
    }
}
