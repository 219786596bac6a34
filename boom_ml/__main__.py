from boom_ml.predict import main

main()
