"""`python -m jaxpar.data {prepare,verify,train-tokenizer} ...`: prepare, verify and tokenize a
corpus. The commands are `jaxpar.corpus.data`'s."""

if __name__ == "__main__":
    import sys

    from jaxpar.corpus.data import main

    sys.exit(main())
