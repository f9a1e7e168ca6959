//! The checker: a store and the model, side by side, op by op, until they disagree.

use super::*;

/// The first answer a store gave that the [`Model`] did not, from [`try_check`].
#[derive(Clone, Debug)]
pub struct Mismatch {
    /// The index of the op in the sequence.
    pub index: usize,
    /// The op.
    pub op: Op,
    /// What the model answered.
    pub expected: Answer,
    /// What the store answered, in the model's terms; `Err` describes an answer that has
    /// none (a store error other than fenced, an unknown token, a missing frozen request…).
    pub actual: Result<Answer, String>,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "op #{} {:?}: the model answers {:?}, the store answered ",
            self.index, self.op, self.expected
        )?;
        match &self.actual {
            Ok(answer) => write!(f, "{answer:?}"),
            Err(other) => f.write_str(other),
        }
    }
}

impl std::error::Error for Mismatch {}

/// Run `ops` against `store` and a fresh `model`, panicking at the first disagreement with
/// the op's index, the op and both answers. See [`try_check`].
pub async fn check<A, F>(store: &dyn IdempotencyStore, model: Model, ops: &[Op], advance: A)
where
    A: FnMut(Duration) -> F,
    F: Future<Output = ()>,
{
    if let Err(mismatch) = try_check(store, model, ops, advance).await {
        panic!("the store disagrees with the reference model: {mismatch}");
    }
}

/// Run `ops` against `store` and `model` side by side; the first disagreement is the error.
///
/// `model` must be fresh ([`Model::new`]): every key starts absent, on keys the checker
/// makes up (random [`LedgerKey`]s), so a shared backend's other data does not matter.
/// `advance` moves the store's clock for each [`Op::Advance`]: `tokio::time::advance` for a
/// store on tokio's paused clock, a real sleep for one with its own clock. On success the
/// model is handed back, in the state the store should be in.
pub async fn try_check<A, F>(
    store: &dyn IdempotencyStore,
    mut model: Model,
    ops: &[Op],
    mut advance: A,
) -> Result<Model, Mismatch>
where
    A: FnMut(Duration) -> F,
    F: Future<Output = ()>,
{
    assert!(
        model.records.is_empty() && model.now.is_zero(),
        "try_check needs a fresh Model"
    );
    let mut world = World::default();
    for (index, op) in ops.iter().enumerate() {
        // A forget is judged against the record as it stands before it: which life that is,
        // the checker must know to name its generation.
        let life_before = match *op {
            Op::Forget { key, .. } => model.record(key).map(|record| record.life),
            _ => None,
        };
        let expected = model.apply(op);
        let actual = world
            .run(store, &model, op, life_before, &mut advance)
            .await;
        // Time left is at most a lease (or what the model says, for a held lease of zero).
        let bound = |expected: &Duration| model.lease.max(*expected);
        let agree = match (&expected, &actual) {
            (Answer::Busy { retry_after: most }, Ok(Answer::Busy { retry_after })) => {
                *retry_after <= bound(most)
            }
            (Answer::Live { lease_left: most }, Ok(Answer::Live { lease_left })) => {
                *lease_left <= bound(most)
            }
            (expected, Ok(actual)) => expected == actual,
            (_, Err(_)) => false,
        };
        if !agree {
            return Err(Mismatch {
                index,
                op: op.clone(),
                expected,
                actual,
            });
        }
    }
    Ok(model)
}

/// The real values the abstract ones stand for, made on first use.
#[derive(Default)]
struct World {
    keys: HashMap<Key, LedgerKey>,
    tokens: HashMap<Token, LeaseToken>,
    token_names: HashMap<LeaseToken, Token>,
    requests: HashMap<Fp, FrozenRequest>,
    fingerprints: HashMap<Fingerprint, Fp>,
    /// The generation the store showed for each life of a key, learnt at its forgets.
    generations: HashMap<(Key, u32), Generation>,
}

impl World {
    async fn run<A, F>(
        &mut self,
        store: &dyn IdempotencyStore,
        model: &Model,
        op: &Op,
        life_before: Option<u32>,
        advance: &mut A,
    ) -> Result<Answer, String>
    where
        A: FnMut(Duration) -> F,
        F: Future<Output = ()>,
    {
        match *op {
            Op::Advance(by) => {
                advance(by).await;
                Ok(Answer::Ok)
            }
            Op::Begin {
                key,
                fingerprint,
                token,
                take_over,
            } => {
                let frozen = self.request(fingerprint);
                let mut request = BeginRequest::new(
                    self.key(key),
                    frozen.fingerprint(),
                    model.lease,
                    model.retention,
                )
                .with_frozen(frozen)
                .with_token(self.token(token));
                if !take_over {
                    request = request.probe();
                }
                match store.begin(request).await {
                    Ok(begin) => self.name_begin(begin),
                    Err(err) if err.is_fenced() => Ok(Answer::Fenced),
                    Err(err) => Err(format!("Err({err}) from begin")),
                }
            }
            Op::Complete {
                key,
                token,
                outcome,
            } => {
                let outcome = Outcome::Response(StoredResponse::new(
                    StatusCode::CREATED,
                    Version::HTTP_11,
                    HeaderMap::new(),
                    Bytes::from(format!("outcome-{}", outcome.0)),
                ));
                let written = store
                    .complete(self.key(key), self.token(token), outcome, model.retention)
                    .await;
                name_write(written)
            }
            Op::Abandon { key, token } => {
                name_write(store.abandon(self.key(key), self.token(token)).await)
            }
            Op::MarkInDoubt { key, token } => {
                let written = store
                    .mark_in_doubt(self.key(key), self.token(token), model.retention)
                    .await;
                name_write(written)
            }
            Op::Forget {
                key,
                life,
                kind,
                fingerprint,
                attempts,
                force,
            } => {
                if let Some(current) = life_before {
                    self.learn_generation(store, key, current).await?;
                }
                // A life the store never showed (an earlier one not looked at, a later one)
                // gets a generation of its own: the store must answer it `Changed`.
                let generation = self
                    .generations
                    .get(&(key, life))
                    .copied()
                    .unwrap_or_else(Generation::random);
                let fingerprint = self.request(fingerprint).fingerprint();
                let mut expected = Expected::new(kind, fingerprint, attempts, generation);
                if force {
                    expected = expected.force();
                }
                match store.forget(self.key(key), expected).await {
                    Ok(Forget::Forgotten) => Ok(Answer::Forgotten),
                    Ok(Forget::Absent) => Ok(Answer::Absent),
                    Ok(Forget::Changed) => Ok(Answer::Changed),
                    Ok(Forget::Live { lease_left }) => Ok(Answer::Live { lease_left }),
                    Err(err) => Err(format!("Err({err}) from forget")),
                }
            }
            Op::Renew { key, token } => {
                let written = store
                    .renew(self.key(key), self.token(token), model.lease)
                    .await;
                name_write(written)
            }
            Op::Hold { key, token } => {
                let held = store.hold_lease(self.key(key), self.token(token), model.lease);
                Ok(if held { Answer::Held } else { Answer::NotHeld })
            }
            Op::LetGo { key, token } => {
                store.let_go(self.key(key), self.token(token), model.lease);
                Ok(Answer::Ok)
            }
        }
    }

    /// Look at `key`'s record, which the model says is its life `life`: the first look at
    /// a life learns its generation, every later one must show the same (a transition
    /// never changes it), and no two lives of a key may show one.
    async fn learn_generation(
        &mut self,
        store: &dyn IdempotencyStore,
        key: Key,
        life: u32,
    ) -> Result<(), String> {
        let view = match store.inspect(self.key(key)).await {
            Ok(Some(view)) => view,
            Ok(None) => {
                return Err(format!(
                    "no record at inspect, where the model has life {life}"
                ))
            }
            Err(err) => return Err(format!("Err({err}) from inspect")),
        };
        let known = *self
            .generations
            .entry((key, life))
            .or_insert(view.generation);
        if known != view.generation {
            return Err(format!(
                "life {life} of the key showed generation {known}, now {}",
                view.generation
            ));
        }
        let shared = self
            .generations
            .iter()
            .any(|(&(other_key, other), &seen)| other_key == key && other != life && seen == known);
        if shared {
            return Err(format!("generation {known} shown by two lives of the key"));
        }
        Ok(())
    }

    fn key(&mut self, key: Key) -> LedgerKey {
        *self.keys.entry(key).or_insert_with(|| {
            let mut bytes = [0u8; 32];
            fastrand::fill(&mut bytes);
            LedgerKey::from_bytes(bytes)
        })
    }

    fn token(&mut self, token: Token) -> LeaseToken {
        if let Some(real) = self.tokens.get(&token) {
            return *real;
        }
        let real = loop {
            let real = LeaseToken::generate();
            if !self.token_names.contains_key(&real) {
                break real;
            }
        };
        self.tokens.insert(token, real);
        self.token_names.insert(real, token);
        real
    }

    fn request(&mut self, fp: Fp) -> FrozenRequest {
        if let Some(frozen) = self.requests.get(&fp) {
            return frozen.clone();
        }
        let frozen = FrozenRequest::from_parts(
            Method::POST,
            "http://provider.local/model".parse().expect("static URI"),
            Version::HTTP_11,
            HeaderMap::new(),
            Bytes::from(format!("{{\"payload\":{}}}", fp.0)),
        );
        self.fingerprints.insert(frozen.fingerprint(), fp);
        self.requests.insert(fp, frozen.clone());
        frozen
    }

    fn name_token(&self, token: LeaseToken) -> Result<Token, String> {
        self.token_names
            .get(&token)
            .copied()
            .ok_or_else(|| format!("a token the test never sent ({token:?})"))
    }

    fn name_fingerprint(&self, fingerprint: Fingerprint) -> Result<Fp, String> {
        self.fingerprints
            .get(&fingerprint)
            .copied()
            .ok_or_else(|| format!("a fingerprint the test never sent ({fingerprint:?})"))
    }

    /// The payload of a frozen request a store handed back (`what` names the answer).
    fn name_frozen(&self, frozen: Option<FrozenRequest>, what: &str) -> Result<Fp, String> {
        let frozen = frozen.ok_or_else(|| format!("{what} without the stored frozen request"))?;
        let fp = self.name_fingerprint(frozen.fingerprint())?;
        if frozen.body() != self.requests[&fp].body() {
            return Err(format!("{what} with altered frozen bytes ({frozen:?})"));
        }
        Ok(fp)
    }

    fn name_begin(&self, begin: Begin) -> Result<Answer, String> {
        Ok(match begin {
            Begin::Acquired { token } => Answer::Acquired {
                token: self.name_token(token)?,
            },
            Begin::Busy { retry_after } => Answer::Busy { retry_after },
            Begin::Resume { token, frozen } => Answer::Resume {
                token: self.name_token(token)?,
                frozen: self.name_frozen(frozen, "Resume")?,
            },
            Begin::InDoubt => Answer::InDoubt,
            Begin::Replay(Outcome::Response(response)) => {
                let id = std::str::from_utf8(&response.body())
                    .ok()
                    .and_then(|body| body.strip_prefix("outcome-"))
                    .and_then(|id| id.parse().ok())
                    .filter(|_| response.status() == StatusCode::CREATED);
                match id {
                    Some(id) => Answer::Replay(OutcomeId(id)),
                    None => {
                        return Err(format!(
                            "Replay of an outcome never recorded ({response:?}, body {:?})",
                            response.body()
                        ))
                    }
                }
            }
            Begin::Replay(tombstone @ Outcome::Tombstone { .. }) => {
                return Err(format!(
                    "Replay({tombstone:?}) where a whole response was recorded"
                ))
            }
            Begin::Drift { stored, frozen } => {
                let stored = self.name_fingerprint(stored)?;
                let frozen = self.name_frozen(frozen, "Drift")?;
                if frozen != stored {
                    return Err(format!(
                        "Drift reporting {stored:?} on record but the frozen request of {frozen:?}"
                    ));
                }
                Answer::Drift { stored }
            }
            // A store that keeps only the fields of a completed operation's request: they
            // must be those of the payload on record.
            Begin::DriftFields { stored, fields } => {
                let stored = self.name_fingerprint(stored)?;
                let unchanged = fields.changed_fields(self.requests[&stored].body());
                if unchanged.as_deref() != Some(&[][..]) {
                    return Err(format!(
                        "DriftFields reporting {stored:?} on record but the fields of another \
                         payload ({fields:?}: {unchanged:?})"
                    ));
                }
                Answer::Drift { stored }
            }
        })
    }
}

fn name_write(written: Result<(), StoreError>) -> Result<Answer, String> {
    match written {
        Ok(()) => Ok(Answer::Ok),
        Err(err) if err.is_fenced() => Ok(Answer::Fenced),
        Err(err) => Err(format!("Err({err})")),
    }
}

impl fmt::Debug for World {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("World")
            .field("keys", &self.keys)
            .field("tokens", &self.tokens)
            .finish_non_exhaustive()
    }
}
