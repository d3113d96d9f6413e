//! The ledger: accounts, their balances, and the operations applied to them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use serde::Serialize;
use uuid::Uuid;

/// The accounts, in memory. Cheap to clone; clones share the accounts.
///
/// Applying an operation is not idempotent by nature: every call adds its amount
/// again. That is what the idempotency middleware protects.
///
/// ```
/// use payments::{Ledger, OperationKind};
///
/// let ledger = Ledger::new();
/// ledger.apply("acct-1", OperationKind::Deposit, 100)?;
/// ledger.apply("acct-1", OperationKind::Charge, 25)?;
/// let account = ledger.account("acct-1");
/// assert_eq!((account.balance, account.operations), (125, 2));
/// # Ok::<(), payments::LedgerError>(())
/// ```
#[derive(Clone, Debug, Default)]
pub struct Ledger {
    accounts: Arc<Mutex<HashMap<String, AccountState>>>,
}

/// Charges and deposits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OperationKind {
    /// A charge through the payment provider.
    Charge,
    /// A deposit.
    Deposit,
}

/// An operation the ledger applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Applied {
    /// The operation's id.
    pub id: Uuid,
    /// The balance after it.
    pub balance: i64,
}

/// An account as `GET /accounts/{account_id}` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct AccountView {
    /// The account.
    pub account_id: String,
    /// The sum of every amount applied.
    pub balance: i64,
    /// How many charges and deposits were applied.
    pub operations: u64,
}

/// Why an operation was not applied.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LedgerError {
    /// The balance would leave the range of a 64-bit integer.
    #[error("the balance of {account_id} would overflow")]
    Overflow {
        /// The account.
        account_id: String,
    },
}

#[derive(Debug, Default)]
struct AccountState {
    balance: i64,
    operations: Vec<(Uuid, OperationKind, i64)>,
}

impl Ledger {
    /// An empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `amount` to the account's balance and records the operation.
    pub fn apply(
        &self,
        account_id: &str,
        kind: OperationKind,
        amount: i64,
    ) -> Result<Applied, LedgerError> {
        let mut accounts = self.accounts.lock().unwrap_or_else(PoisonError::into_inner);
        let account = accounts.entry(account_id.to_owned()).or_default();
        let balance = account
            .balance
            .checked_add(amount)
            .ok_or_else(|| LedgerError::Overflow {
                account_id: account_id.to_owned(),
            })?;
        let id = Uuid::new_v4();
        account.balance = balance;
        account.operations.push((id, kind, amount));
        Ok(Applied { id, balance })
    }

    /// The account; an unknown one reads as balance 0 and no operations.
    pub fn account(&self, account_id: &str) -> AccountView {
        let accounts = self.accounts.lock().unwrap_or_else(PoisonError::into_inner);
        let (balance, operations) = accounts.get(account_id).map_or((0, 0), |account| {
            (account.balance, account.operations.len() as u64)
        });
        AccountView {
            account_id: account_id.to_owned(),
            balance,
            operations,
        }
    }
}
