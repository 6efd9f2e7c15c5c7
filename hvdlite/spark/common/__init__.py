"""What the Spark estimators share: the store (:mod:`.store`), the data path from a DataFrame
to the ranks (:mod:`.data`) and the estimator/model base classes (:mod:`.estimator`)."""
